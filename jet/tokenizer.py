"""A model's tokenizer and chat template without torch or transformers: what an env worker needs.

What it is: `ChatTokenizer.load(path)` reads a Hugging Face model folder's `tokenizer.json` with
the `tokenizers` library and its chat template (`chat_template.jinja` and
`additional_chat_templates/*.jinja`, else `tokenizer_config.json`'s `chat_template`, else a
`chat_template.json`), and renders it in a sandboxed Jinja2 environment set up as transformers sets
up its own: `trim_blocks`, `lstrip_blocks`, the loop-control extension, `{% generation %}` blocks, a `tojson` filter that does not escape
HTML, and the globals templates call (`raise_exception`, `strftime_now`, `namespace`, `dict`). The
template sees the messages (keys whose value is None dropped, rich objects reduced to plain JSON
data), `tools`, `documents`, `add_generation_prompt` and the named special tokens (`bos_token`,
`eos_token`, ...). Encoding and decoding are the `tokenizers` library's own calls, with no special
tokens added on encode and none skipped on decode, which is what `jet.chat.Template` asks of a
transformers tokenizer; `tests/test_tokenizer.py` checks the two give the same text and ids on every
template the tests use.

Why: an env worker only renders templates and turns text into ids; importing transformers (and with
it libtorch) for that costs a client process ~400 MB of resident memory and the client install
several GB (see docs/deployment.md, "Client nodes").

What it is not: a slow (Python or sentencepiece) tokenizer. A folder without `tokenizer.json` is
loaded with transformers when it is installed (`load_tokenizer`), and is an error naming the missing
file and the extra to install when it is not.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

from jet.errors import ConfigError

# The named special tokens a template sees, as transformers passes them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # names a message's reasoning comes under


class ChatTokenizer:
    """`tokenizers.Tokenizer` + the folder's chat template: render, encode, decode, vocabulary."""

    def __init__(self, tokenizer: Any, chat_template: str | dict[str, str] | None,
                 special_tokens: Mapping[str, str] | None = None, model_max_length: int | None = None,
                 path: str = ""):
        self._tk = tokenizer
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens or {})
        self.model_max_length = model_max_length
        self.path = path
        for name in SPECIAL_TOKENS:
            setattr(self, name, self.special_tokens_map.get(name))

    @classmethod
    def load(cls, path: str | Path) -> "ChatTokenizer":
        from tokenizers import Tokenizer

        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"{folder}: no tokenizer.json (a fast tokenizer is needed without transformers)")
        config = _json(folder / "tokenizer_config.json")
        legacy = _json(folder / "special_tokens_map.json")
        special = {}
        for name in SPECIAL_TOKENS:
            value = _token_text(config.get(name, legacy.get(name)))
            if value is not None:
                special[name] = value
        limit = config.get("model_max_length")
        return cls(Tokenizer.from_file(str(file)), _chat_template(folder, config), special,
                   limit if isinstance(limit, int) else None, str(folder))

    # -- the calls jet.chat.Template and the gateway make ---------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not supported: token-exact decoding only")
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tk.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        """Tokens in the vocabulary, added tokens included (as `len()` of a transformers tokenizer)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._tk.token_to_id(self.eos_token) if self.eos_token else None

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None,
                            documents: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """The rendered conversation (token ids with tokenize=True, no special tokens added)."""
        source = self._template(chat_template, tools)
        messages = [{k: v for k, v in _plain(m).items() if v is not None} for m in _messages(conversation)]
        text = _compiled(source).render(
            messages=[_with_reasoning(m) for m in messages],
            tools=None if tools is None else [_plain(t) for t in _schemas(tools)],
            documents=None if documents is None else _plain(list(documents)),
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **_plain(kwargs)})
        return self.encode(text) if tokenize else text

    def _template(self, name: str | None, tools: Sequence[Any] | None) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if name is not None and name in templates:
                return templates[name]
            if name is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError(f"{self.path}: several chat templates and none is the default: {sorted(templates)}")
            return name
        if name is not None:
            return name
        if templates is None:
            raise ValueError(f"{self.path}: this tokenizer has no chat template")
        return templates


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer an env worker or gateway uses for a model folder: lean when the folder has a
    `tokenizer.json`, transformers' otherwise (when transformers is installed)."""
    folder = Path(path)
    if (folder / "tokenizer.json").is_file():
        return ChatTokenizer.load(folder)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"{folder}: no tokenizer.json; this model's slow tokenizer needs transformers "
                          "(pip install 'jet-rl[infer]')") from None
    return AutoTokenizer.from_pretrained(str(folder))


# ---- the template environment


@lru_cache(maxsize=32)
def _compiled(source: str) -> Any:
    return _environment().from_string(source)


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters (<, >, &, '), which no chat template wants.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore names, so a template cannot reach internals."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (marks what the assistant wrote): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=Namespace, dict=Dict())
    return env


# ---- inputs and files


def _messages(conversation: Any) -> list[Mapping[str, Any]]:
    messages = list(getattr(conversation, "messages", conversation))
    if not messages:
        raise ValueError("cannot render an empty conversation")
    for m in messages:
        if not isinstance(m, Mapping) and not dataclasses.is_dataclass(m) and not hasattr(m, "model_dump"):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
    return messages


def _with_reasoning(m: dict) -> dict:
    """A message's reasoning under the names templates read (`reasoning_content`, and `thinking`)."""
    reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def _schemas(tools: Sequence[Any]) -> list[dict]:
    out = []
    for t in tools:
        if not isinstance(t, Mapping):
            raise ValueError(f"tools must be JSON schemas (dicts), got {t!r}")
        out.append(t)
    return out


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, so the sandboxed template sees no object with methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump"):  # a pydantic model (an OpenAI SDK message)
        return _plain(value.model_dump(exclude_none=True))
    if hasattr(value, "item") and callable(value.item):  # a numpy scalar
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):  # a serialised AddedToken
        return value["content"]
    return None


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template(s): files beside the config win over the config's entry."""
    templates: dict[str, str] = {}
    if (folder / "chat_template.jinja").is_file():
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = config.get("chat_template", _json(folder / "chat_template.json").get("chat_template"))
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in value if isinstance(t, Mapping) and "name" in t}
        return named or None
    return value if isinstance(value, str) else None
