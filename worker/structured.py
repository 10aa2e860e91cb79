"""OpenAI's response_format and forced tool calls -> the engine's StructuredOutputsParams (and the param of its
errors)."""

from __future__ import annotations

from sluice.api.batch_lines import GUIDED, Body, CompletionBody
from sluice.worker.engine.structured_outputs import StructuredOutputsParams
from sluice.worker.tool_calls import call_schema, forced

# the param of an error line for a grammar the engine could not compile: a RequestOutput's `error`, set by the engine
# only for a request it took and then failed, which is only that
RESPONSE_FORMAT = "body.response_format"
TOOLS = "body.tools"


def grammar_param(body: Body) -> str:
    """The field whose grammar a failed compile blames: the tools for a forced call (the API refuses a forced call
    beside a response_format), a completion's guided_* field, else response_format."""
    if forced(body) is not None:
        return TOOLS
    if isinstance(body, CompletionBody):
        return next((f"body.{f}" for f in GUIDED if getattr(body, f) is not None), RESPONSE_FORMAT)
    return RESPONSE_FORMAT


def structured_outputs(body: Body) -> StructuredOutputsParams | None:
    """The grammar a valid body asks for (api/response_format.py and api/tools.py checked its shape); ValueError if
    the engine would refuse it."""
    if (tools := forced(body)) is not None:
        return StructuredOutputsParams(json=call_schema(tools))
    if isinstance(body, CompletionBody):
        return _guided(body)
    fmt = body.response_format
    if fmt is None or fmt["type"] == "text":
        return None
    schema = fmt.get("json_schema", {}).get("schema")
    # strict or not, any schema xgrammar compiles is honoured in full: sluice need not keep to OpenAI's strict subset
    return StructuredOutputsParams(json=schema) if schema is not None else StructuredOutputsParams(json_object=True)


def _guided(body: CompletionBody) -> StructuredOutputsParams | None:
    if body.guided_json is not None:
        return StructuredOutputsParams(json=body.guided_json)
    if body.guided_regex is not None:
        return StructuredOutputsParams(regex=body.guided_regex)
    if body.guided_choice is not None:
        return StructuredOutputsParams(choice=tuple(body.guided_choice))
    return None
