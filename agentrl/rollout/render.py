"""Chat messages to token ids with the tokenizer's own template, turn by turn: the prompt once, then
each observation as the text the template adds after an assistant turn, so that the work per turn
does not grow with the episode and earlier tokens are never rendered again."""

from __future__ import annotations

import re

_SURROGATE = re.compile("[\ud800-\udfff]")


class Renderer:
    """Turns chat messages into token ids with the tokenizer's template, a constant amount of work per turn."""

    def __init__(self, tokenizer, end_of_turn: str | None):
        self.tok = tokenizer
        self.eot = end_of_turn or tokenizer.eos_token
        if self.eot is None:
            raise ValueError(
                "the tokenizer has no eos token; set LoopConfig.end_of_turn to the end-of-turn token"
            )
        self.eot_id = tokenizer.convert_tokens_to_ids(self.eot)
        if self.eot_id is None or self.encode(self.eot) != [self.eot_id]:
            raise ValueError(
                f"loop.end_of_turn={self.eot!r} is not one token of the tokenizer (it encodes as "
                f"{self.encode(self.eot)}); name the token that ends an assistant turn"
            )
        # A fixed short conversation: the text the template puts after its last end-of-turn token is
        # the "glue" before the next messages. It ends with an assistant turn, as observations follow
        # one, unless the template renders the last assistant turn apart from earlier ones (Qwen3's
        # think block); then with the user turn before it, whose text does not change as messages follow.
        user, assistant = {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}
        probe = [{"role": "tool", "content": "c", "name": "bash", "tool_call_id": "call_0"}]
        self._base, self._base_text = [user, assistant], self._up_to_last_eot([user, assistant])
        try:
            appends = self._render(self._base + probe).startswith(self._base_text)
        except Exception:  # a template that takes no tool messages: its envs send none; as before
            appends = True
        if not appends:
            self._base, self._base_text = [user], self._up_to_last_eot([user])

    def _up_to_last_eot(self, messages) -> str:
        text = self._render(messages, add_generation_prompt=False)
        cut = text.rfind(self.eot)
        if cut < 0:
            raise ValueError(
                f"the chat template does not end turns with {self.eot!r}; set LoopConfig.end_of_turn"
            )
        return text[: cut + len(self.eot)]

    def _render(self, messages, tools=None, add_generation_prompt=True) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        if _SURROGATE.search(text):  # a lone surrogate (from a call's JSON, echoed back) cannot be encoded
            text = _SURROGATE.sub("\ufffd", text)
        return self.tok.encode(text, add_special_tokens=False)

    def prompt(self, messages, tools) -> list[int]:
        text = self._render(messages, tools)
        if tools and text == self._render(messages, None):
            # The template ignores tools: describe them in the first system message instead.
            import json

            spec = "\n".join(json.dumps(t) for t in tools)
            note = (
                "You can call these tools; write each call as "
                '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>:\n' + spec
            )
            messages = [dict(m) for m in messages]
            if messages and messages[0]["role"] == "system":
                messages[0]["content"] += "\n\n" + note
            else:
                messages.insert(0, {"role": "system", "content": note})
            text = self._render(messages, None)
        return self.encode(text)

    def observation(self, messages, after_eot: bool) -> list[int]:
        """Ids of ``messages`` and the next generation prompt, to follow an assistant turn."""
        full = self._render(self._base + messages)
        if not full.startswith(self._base_text):
            raise ValueError(
                "the chat template renders earlier turns differently once more follow; cannot append"
            )
        suffix = full[len(self._base_text) :]
        return ([] if after_eot else [self.eot_id]) + self.encode(suffix)
