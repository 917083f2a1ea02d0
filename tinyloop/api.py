"""The public API's convenience entry points: text in / text out (generate_text, stream_text), and
the speculative entry points, thin wrappers that turn a SpeculativeConfig /
TreeSpeculativeConfig into the GenerateConfig of the built-in "speculative" / "tree_speculative"
decoder plugin and run it through the engine like any request. The public API layer may name
built-in plugins; the runtime (tinyloop.runtime) does not."""

from __future__ import annotations

from typing import Any, Iterator, List, Mapping, Optional, Sequence, Union

from .errors import InvalidInputError, TokenizerError

from .runtime.config import GenerateConfig, GenerateStats, SpeculativeConfig, TreeSpeculativeConfig
from .runtime.engine import Model, generate_iter, generate_stream
from .plugins.decoders.spec_session import speculative_request


def generate_speculative(model: Model, prompt: Sequence[int], config: Optional[SpeculativeConfig] = None,
                         stats: Optional[GenerateStats] = None) -> List[int]:
    """Chain self-speculative decoding: draft `draft_ahead` tokens greedily at draft_loops, verify
    them in one forward at verify_loops, accept the longest matching prefix plus one bonus token.
    At temperature 0 the output equals generate(loops=verify_loops). Returns prompt + tokens.
    Same as ``generate(model, prompt, GenerateConfig(decoder="speculative", loops=verify_loops,
    options={draft_loops, verify_loops, draft_ahead, verify_resume}, ...))``."""
    request = speculative_request(config if config is not None else SpeculativeConfig(), tree=False)
    return generate_stream(model, prompt, request, stats=stats)


def generate_tree_speculative(model: Model, prompt: Sequence[int],
                              config: Optional[TreeSpeculativeConfig] = None,
                              stats: Optional[GenerateStats] = None) -> List[int]:
    """Tree self-speculative decoding: each draft step keeps the K_branches most likely tokens of
    every node, building a tree of depth draft_ahead; one tree-masked forward at verify_loops
    scores every node, and the longest path the verify pass agrees with is committed (plus one
    bonus token). At temperature 0 the output equals generate(loops=verify_loops). Returns
    prompt + tokens. Same as generate with decoder="tree_speculative" (options also K_branches)."""
    request = speculative_request(config if config is not None else TreeSpeculativeConfig(), tree=True)
    return generate_stream(model, prompt, request, stats=stats)


# --------------------------------------------------------------------------- text in, text out
def stream_text(model: Model, prompt: Union[str, Sequence[int]], config: Optional[GenerateConfig] = None,
                stats: Optional[GenerateStats] = None) -> Iterator[str]:
    """Yield the completion as text while it is generated: each piece is the text the tokens so
    far complete (a character split across tokens comes whole, once its last byte arrives; bytes
    that never complete a character end as U+FFFD). Validation runs before the first ``next()``,
    like generate_iter; closing the generator early stops decoding. The model's EOS token (or one
    of its extra_eos_ids) ends the text and is not part of it (the token ids from generate keep it)."""
    tokens = generate_iter(model, prompt, config, stats=stats)
    return _pieces(model.tokenizer.stream_decoder(continuation=True), tokens, model.cfg.eos_ids)


def _pieces(decoder, tokens, eos_ids=()) -> Iterator[str]:
    try:
        for tok in tokens:
            if tok in eos_ids:
                continue
            piece = decoder.push(tok)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail
    finally:
        tokens.close()


def generate_text(model: Model, prompt: Union[str, Sequence[int]], config: Optional[GenerateConfig] = None,
                  stats: Optional[GenerateStats] = None) -> str:
    """The completion of `prompt` (text or ids) as text, prompt excluded: generate, then the new
    tokens decoded with ``model.tokenizer`` as a continuation of the prompt
    (``decode(new, continuation=True)``: a SentencePiece-style tokenizer keeps the completion's
    leading space), the model's EOS ids left out (``"".join(stream_text(...))``)."""
    return "".join(stream_text(model, prompt, config, stats=stats))


def apply_chat_template(model: Model, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        tokenize: bool = True, **template_kwargs: Any) -> Union[List[int], str]:
    """A conversation as the model's prompt, rendered by its own chat template (embedded by
    ``convert --hf`` from the checkpoint's tokenizer_config.json or chat_template.jinja; or the
    tokenizer directory given to load_model): `messages` is a list of ``{"role", "content"}``
    mappings; `add_generation_prompt` ends the text where the assistant's reply begins; extra
    keywords reach the template (``tools=...``). ``tokenize=True`` returns the token ids to pass
    to generate (the template writes the model's BOS text itself, so no BOS id is added, as
    transformers' apply_chat_template does); ``tokenize=False`` the text. A model without a
    template is a TokenizerError, before any work."""
    from .model.chat import check_arguments, render
    from .runtime.engine import check_call
    check_call(model)
    model._check_live()
    if not isinstance(tokenize, bool):
        raise InvalidInputError(f"tokenize must be True or False, got {tokenize!r:.40}")
    messages = check_arguments(messages, add_generation_prompt, template_kwargs)   # the arguments first
    tok = model.tokenizer
    if tok.chat_template is None:
        raise TokenizerError(f"the model's tokenizer ({tok.name}) has no chat template: convert from a Hugging "
                             f"Face directory whose tokenizer_config.json (or chat_template.jinja) has one, or "
                             f"load the model with tokenizer=DIR of such a directory")
    c, special = model.cfg, tok.special_tokens
    # the checkpoint's special-token texts (tokenizer_config.json's, as transformers renders them),
    # else those of the model's BOS / EOS ids
    bos = special.get("bos_token", "" if c.bos_id is None else tok.token_text(c.bos_id))
    eos = special.get("eos_token", "" if c.eos_id is None else tok.token_text(c.eos_id))
    text = render(tok.chat_template, messages, add_generation_prompt, bos_token=bos, eos_token=eos,
                  extra=template_kwargs, special=special)
    return tok.encode(text) if tokenize else text
