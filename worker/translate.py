"""Between OpenAI request bodies and the engine: prompt tokens and SamplingParams in, response bodies out."""

from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from api.schemas import CHAT_URL, PROMPT_FIELDS, Body, Generation, TokenLogprob, chat_messages, sampling_args
from worker.engine import InputProcessor, RequestOutput, RequestRejected, SamplingParams
from worker.engine.detokenizer import TokenText, decode


class PromptError(ValueError):
    """A valid body the engine cannot run; `code` and `param` in OpenAI's terms."""

    def __init__(self, code: str, message: str, param: str):
        super().__init__(message)
        self.code, self.param = code, param


def engine_inputs(processor: InputProcessor, url: str, body: Body) -> tuple[list[int], SamplingParams]:
    """The prompt's token ids (chat template applied) and sampling parameters; PromptError if it cannot run."""
    if url == CHAT_URL:
        try:
            token_ids = processor.encode_chat(chat_messages(body))
        except Exception as e:  # the template is the model's code: any error in it fails this line only (as vLLM)
            raise PromptError("invalid_prompt", f"the chat template failed: {e}", "body.messages") from None
    else:
        token_ids = processor.encode(body.prompt)
    try:
        params = SamplingParams(**sampling_args(body, processor.max_request_tokens - len(token_ids)))
    except ValueError as e:  # the schema's limits match SamplingParams'; never lose the batch if they drift
        raise PromptError("invalid_value", str(e), "body") from None
    try:
        processor.check(token_ids, params)
    except RequestRejected as e:
        raise PromptError(e.code, str(e), PROMPT_FIELDS[url]) from None
    return token_ids, params


class Responses:
    """Builds response generations from engine outputs, caching each token's text for logprobs; decodes the text
    of an output the engine did not detokenize (SamplingParams.detokenize=False) as the engine would have."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.texts = TokenText.of(tokenizer)
        self.token_text: dict[int, str] = {}
        # a token's text is read after this one: alone, decode() drops a SentencePiece token's leading space
        self.anchor = tokenizer.encode("a", add_special_tokens=False)
        self.anchor_text = tokenizer.decode(self.anchor)

    def generation(self, out: RequestOutput) -> Generation:
        logprobs = None
        if out.logprobs is not None:
            logprobs = [TokenLogprob(self._token(lp.token_id), lp.logprob, [(self._token(t), v) for t, v in lp.top])
                        for lp in out.logprobs]
        text = out.text
        if text is None:
            # without detokenizing the engine matched no stop strings: a "stop" is an eos or stop token
            text = decode(self.tokenizer, self.texts, out.prompt_token_ids, out.token_ids, out.finish_reason == "stop")
        return Generation(text=text, finish_reason=out.finish_reason, prompt_tokens=len(out.prompt_token_ids),
                          completion_tokens=len(out.token_ids), cached_tokens=out.num_cached_tokens,
                          created=int(out.metrics.finish_time or time.time()), logprobs=logprobs)

    def _token(self, token_id: int) -> str:
        """The token's text as a piece of the text around it (OpenAI's logprob tokens join into the text)."""
        if token_id not in self.token_text:
            text = self.tokenizer.decode([token_id])
            if token_id not in self.texts.special_ids:
                after = self.tokenizer.decode(self.anchor + [token_id])
                text = after[len(self.anchor_text):] if after.startswith(self.anchor_text) else text
            self.token_text[token_id] = text
        return self.token_text[token_id]
