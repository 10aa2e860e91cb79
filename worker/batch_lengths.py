"""The sequence lengths of a batch file's requests, as the engine would run them: prompts tokenized (chat template
applied) by the model's tokenizer alone, plus each line's max_tokens (chat's default: the rest of the context)."""

from __future__ import annotations

from pathlib import Path

from sluice.api.batch_lines import BatchValidator, LineError
from sluice.worker.engine.config import EngineConfig, ModelConfig
from sluice.worker.engine.processor import InputProcessor, load_tokenizer
from sluice.worker.translate import PromptError, engine_inputs


def batch_lengths(path: Path, model_dir: Path, config: EngineConfig, model_config: ModelConfig,
                  max_model_len: int) -> tuple[list[int], int]:
    """Prompt plus max_tokens of each sequence (n of them for a line with n choices), and the lines that would not
    run (invalid, or longer than max_model_len), which are left out."""
    # a cache that holds max_model_len: only the model's limit refuses a line, not a guess at the cache
    blocks = -(-max_model_len // config.block_size)
    processor = InputProcessor(load_tokenizer(model_dir), config, model_config, max_model_len, blocks)
    validator = BatchValidator()
    lengths: list[int] = []
    skipped = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            request = validator.validate(raw, number)
            if isinstance(request, LineError):
                skipped += 1
                continue
            try:
                token_ids, params = engine_inputs(processor, request.url, request.body)
            except PromptError:
                skipped += 1
                continue
            lengths += [len(token_ids) + params.max_tokens] * params.n
    return lengths, skipped
