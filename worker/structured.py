"""OpenAI's response_format -> the engine's StructuredOutputsParams (and the param of its errors)."""

from __future__ import annotations

from sluice.api.batch_lines import Body, ChatBody
from sluice.worker.engine.structured_outputs import StructuredOutputsParams

# the param of an error line for a grammar the engine could not compile: a RequestOutput's `error`, set by the engine
# only for a request it took and then failed, which is only that
RESPONSE_FORMAT = "body.response_format"


def structured_outputs(body: Body) -> StructuredOutputsParams | None:
    """The grammar a valid body asks for (api/response_format.py checked its shape); ValueError if the engine
    would refuse it."""
    fmt = body.response_format if isinstance(body, ChatBody) else None
    if fmt is None or fmt["type"] == "text":
        return None
    schema = fmt.get("json_schema", {}).get("schema")
    # strict or not, any schema xgrammar compiles is honoured in full: sluice need not keep to OpenAI's strict subset
    return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)
