"""The served model's tokenizer, chat template and length limits, loaded from its directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from splitserve.errors import InvalidArgument
from splitserve.model_kind import DIFFUSION_MODEL_TYPES
from splitserve.detokenizer import IncrementalDetokenizer
from splitserve.core.records import DIFFUSION

# Used when the tokenizer ships no chat_template. Each message becomes "<|role|>\ncontent\n"
# and the prompt ends with "<|assistant|>\n"; the tokenizer adds its BOS (if it has one)
# because this text, unlike a real template's, does not contain it.
DEFAULT_CHAT_TEMPLATE_DOC = "<|{role}|>\\n{content}\\n ... <|assistant|>\\n"

# config.json keys that hold the context length, in order of preference.
_MAX_LEN_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "max_seq_len")


def render_default_chat(messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> str:
    """The default chat prompt: "<|role|>\\ncontent\\n" per message, then "<|assistant|>\\n"
    (unless `add_generation_prompt` is false); `continue_final_message` leaves the last
    message without its closing newline, for the model to continue."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    if continue_final_message and parts:
        parts[-1] = parts[-1][:-1]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def read_model_limits(model_dir: str | os.PathLike) -> tuple[int, int, str]:
    """(max_model_len, vocab_size, model_type) from a Hugging Face config.json."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"model directory {model_dir} has no config.json") from None
    # Multimodal checkpoints nest the language model's config.
    text_config = config.get("text_config") or {}
    max_len = next((c[k] for c in (config, text_config) for k in _MAX_LEN_KEYS if isinstance(c.get(k), int)), 0)
    if max_len <= 0:
        raise ValueError(f"{path}: none of {_MAX_LEN_KEYS} is set; cannot tell the model's max length")
    vocab = config.get("vocab_size") or text_config.get("vocab_size") or 0
    return max_len, int(vocab), str(config.get("model_type", ""))


# tokenizer_config.json classes that are the generic tokenizers.json-backed tokenizer itself
# (transformers 5 names it TokenizersBackend; PreTrainedTokenizerFast is the same class).
_GENERIC_FAST_TOKENIZERS = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})


def _generic_fast_tokenizer(model_dir: str | os.PathLike) -> bool:
    """Whether the directory's tokenizer is a plain tokenizer.json one, no model-specific class."""
    path = Path(model_dir)
    if not (path / "tokenizer.json").is_file():
        return False
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return config.get("tokenizer_class") in _GENERIC_FAST_TOKENIZERS


class Tokenization:
    """Prompt encoding, chat templating and token-id checks for the served model."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int = 0, model_type: str = "",
                 mask_token_id: int | None = None):
        self.tokenizer = tokenizer
        self.mask_token_id = mask_token_id  # a diffusion model's mask token
        self.max_model_len = max_model_len
        # The model's embedding table may be larger than the tokenizer (padded vocab); ids
        # past the tokenizer still embed, so the model's size is the bound.
        self.vocab_size = vocab_size or len(tokenizer)
        self.model_type = model_type
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))

    @property
    def engine_family(self) -> str:
        """"diffusion" for a diffusion model, "" for an autoregressive one."""
        return DIFFUSION if self.model_type in DIFFUSION_MODEL_TYPES else ""

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "Tokenization":
        """Load the tokenizer (local files only) and the limits from config.json.

        A `.gguf` file stands for its dequantized directory, the one the workers load.
        """
        from splitserve.gguf import resolve_model_path

        model_dir = resolve_model_path(model_dir)
        max_len, vocab, model_type = read_model_limits(model_dir)
        if model_type in DIFFUSION_MODEL_TYPES or _generic_fast_tokenizer(model_dir):
            # The class AutoTokenizer would pick anyway, without its import of torch (~3 s of
            # every gateway's start, and ~400 MB): a gateway needs no tensors. A diffusion
            # model's type is also unknown to AutoTokenizer, which looks config.json's
            # model_type up among transformers' models.
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        mask = json.loads((Path(model_dir) / "config.json").read_text()).get("mask_token_id")
        return cls(tokenizer, max_len, vocab, model_type, mask if isinstance(mask, int) else None)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, with the tokenizer's special tokens (e.g. BOS) unless told not to."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[str, bool]:
        """The chat prompt text, and whether the tokenizer should still add its special tokens.

        `add_generation_prompt`: end with the assistant's turn opener; `continue_final_message`:
        leave the last message open (no end-of-turn) for the model to continue; `template_kwargs`:
        extra variables for the model's template (vLLM's chat_template_kwargs)."""
        if self.has_chat_template:
            options: dict[str, Any] = dict(template_kwargs or {})
            if continue_final_message:  # passed only when set: a template engine that predates it still works
                options["continue_final_message"] = True
            try:
                text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                          add_generation_prompt=add_generation_prompt, **options)
            except Exception as err:  # jinja raises for role orders a template forbids, etc.
                raise InvalidArgument(f"messages: the model's chat template rejected them: {err}",
                                      param="messages") from None
            # Real templates write BOS themselves; adding it again would double it.
            return text, False
        return render_default_chat(messages, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message), True

    def encode_chat(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, add_special_tokens: bool | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a chat conversation, by default ending with the assistant's turn opener.

        `add_special_tokens` None: as the template needs (a real template writes BOS itself; the
        default one does not); True / False add or leave out the tokenizer's own, as vLLM's field does."""
        text, add_special = self.render_chat(messages, add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message,
                                             template_kwargs=template_kwargs)
        if add_special_tokens is not None:
            add_special = add_special_tokens
        return list(self.tokenizer.encode(text, add_special_tokens=add_special))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens included (what vLLM's /detokenize returns)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (e.g. "Ġthe"), for /tokenize's token_strs."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(ids))]

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        """Token ids as a list, or InvalidArgument naming `param` when one is outside the vocab."""
        ids = list(ids)
        for i, token in enumerate(ids):
            if not 0 <= token < self.vocab_size:
                raise InvalidArgument(
                    f"{param}[{i}] = {token} is not a token id: the vocab has {self.vocab_size} ids "
                    f"(0..{self.vocab_size - 1})", param=param)
        return ids

    def detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str], min_tokens: int = 0) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one request's output."""
        return IncrementalDetokenizer(self.tokenizer, list(prompt_ids), list(stop), min_tokens)
