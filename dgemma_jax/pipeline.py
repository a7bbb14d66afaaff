"""Text in, text out: a model, its tokenizer and a compiled engine in one object.

    from dgemma_jax.pipeline import DiffusionGemma
    dg = DiffusionGemma.from_pretrained("/path/to/checkpoint")   # HF or dgemma_jax dir; None = bundled model
    dg = DiffusionGemma.from_pretrained("gs://bucket/ckpt")      # or any fsspec URL, or a Hub repo id[@revision]
    dg = DiffusionGemma.from_pretrained("gs://bucket/ckpt", mesh="expert=8")   # each host reads its shards' bytes
    dg.generate("s93421=")                     # -> text
    dg.generate(["a12+34=", "s321="])          # -> list of texts (one batch)
    dg.chat([{"role": "user", "content": "Hi!"}])
    dg.generate("<|image|>What is in the picture?", images=["photo.jpg"])   # a checkpoint with a vision tower
    dg.chat([{"role": "user", "content": [{"type": "image", "image": "photo.jpg"},
                                          {"type": "text", "text": "Describe it."}]}])
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from dgemma_jax.chat_session import split_reply
from dgemma_jax.engine import Engine
from dgemma_jax.engine.grammar import compile_grammar, schema_of_response_format
from dgemma_jax.engine.inputs import default_new_tokens
from dgemma_jax.engine.outputs import warn_if_cut_short
from dgemma_jax.errors import DgemmaWarning, UsageError
from dgemma_jax.io.bundled import bundled_choice, load_bundled
from dgemma_jax.io.images import prompt_with_images
from dgemma_jax.io.model_dir import load_model, load_model_tokenizer, open_checkpoint
from dgemma_jax.io.prompts import chat_prompt
from dgemma_jax.model.quant import mode_for, quantize_params
from dgemma_jax.parallel.mesh import make_mesh
from dgemma_jax.parallel.shardings import Shardings
from dgemma_jax.progress import tensor_bar



def load_checkpoint(checkpoint: str | None, dtype: str | None = None, revision: str | None = None, *,
                    mesh=None, rules: str | tuple = "latency", mirror: bool | None = None, quantize: str | None = None,
                    progress=False):
    """-> (config, params, sampler | None, tokenizer); None or "bundled": the bundled small model,
    "bundled:NAME" another bundled model (`dgemma_jax.io.bundled`, e.g. the image model VISION_NAME).

    checkpoint: a local directory, an fsspec URL (gs://...) or a Hugging Face Hub repo id, optionally
    REPO@REVISION (`dgemma_jax.io.locations`); revision: the Hub revision (branch, tag or commit).
    mesh: a `jax.sharding.Mesh` or a mesh spec ("expert=8", `parallel.make_mesh`): the parameters are
    read straight into their shards under `rules` (`parallel.Shardings`), never whole on one device;
    None: on the default device. Each process reads only the bytes of its own shards, from a local
    directory or, for a Hugging Face checkpoint at a URL, straight from the store (`locations.locate`);
    mirror=True copies a URL's weights into the local mirror first (later starts read the copy). A Hub
    repo is downloaded into the Hugging Face cache by a single process (mirror=None), and read in
    ranges by each process of several (or mirror=False).
    quantize: None / "none", "int8", "int4" or "auto" (`model.quant.resolve_quantize`, by the memory of the
    devices the weights go to): a float checkpoint's kernels quantized as they are read, one tensor at a
    time, so the float model is never whole; "auto" leaves a checkpoint saved quantized as it is, an
    explicit mode refuses it (UsageError).
    progress: True: a bar over the tensors of a Hugging Face checkpoint as they are read (and quantized)
    (`dgemma_jax.progress.tensor_bar`); or a wrapper of the tensor iterator (`progress.StartReport.loading`);
    a Hub download shows huggingface_hub's own bars either way."""
    if isinstance(mesh, str):
        mesh = make_mesh(mesh)
    is_bundled, name = bundled_choice(checkpoint)
    if is_bundled:
        if revision is not None:
            raise UsageError("--revision applies to a Hugging Face Hub checkpoint; pass --checkpoint REPO_ID too")
        try:
            cfg, params, sampler, tok = load_bundled(name)
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
        mode = _quantize_mode(cfg, quantize, mesh, None)
        if mode is not None:
            params = quantize_params(cfg, params, mode)
        if mesh is not None:  # a small model: read, then placed
            params = Shardings(cfg, mesh, rules).place_params(params)
        return cfg, params, sampler, tok
    source = open_checkpoint(checkpoint, revision, mirror=mirror)  # located, and its metadata read, once
    shardings = Shardings(source.config, mesh, rules) if mesh is not None else None
    mode = _quantize_mode(source.config, quantize, mesh, source.quantized)
    bar = progress if callable(progress) else \
        tensor_bar("reading weights" + (f" into {mode}" if mode else "")) if progress else None
    tokenizer = load_model_tokenizer(source)  # first: a missing tokenizer is named before the weights are read
    cfg, params, sampler = load_model(source, dtype=dtype, shardings=shardings, quantize=mode, progress=bar)
    mismatch = vocab_mismatch(cfg, tokenizer)
    if mismatch:
        warnings.warn(mismatch, DgemmaWarning, stacklevel=2)
    return cfg, params, sampler, tokenizer


def _quantize_mode(config, quantize, mesh, saved: str | None) -> str | None:
    """`model.quant.mode_for` for a checkpoint being loaded, its errors as one-line usage errors."""
    try:
        return mode_for(config, quantize, saved, mesh.devices.flat if mesh is not None else None)
    except ValueError as e:
        raise UsageError(f"--quantize {quantize}: {e}") from None


def vocab_mismatch(config, tokenizer) -> str | None:
    """A warning when the model can emit ids its tokenizer has no text for (None when it cannot)."""
    n = tokenizer.vocab_size
    if config.vocab_size <= n:
        return None
    return (f"the model's vocab_size is {config.vocab_size} but its tokenizer has {n} ids: a generated id past "
            f"{n - 1} has no text and is written as U+FFFD; pair the checkpoint with the tokenizer it was "
            "trained with")


class DiffusionGemma:
    """config + params + tokenizer + `Engine`; `.generate(text)`, `.chat(messages)`."""

    def __init__(self, config, params, tokenizer, sampler=None, shardings=None, runtime=None,
                 quantize: str | None = None, compilation_cache: bool | str = True, batch_invariant: bool | int = True,
                 lora=None):
        """lora: a LoRA adapter run unmerged beside the weights: the work directory (or a checkpoints/<step>)
        of a `dgemma train` LoRA run, or a `training.adapters.Adapter` (`dgemma generate --lora PATH`)."""
        adapters = None
        if lora is not None:
            # deferred: the adapter reader brings orbax, which `import dgemma_jax` must not load
            from dgemma_jax.training import adapters as adapters_lib

            adapter = lora if isinstance(lora, adapters_lib.Adapter) else adapters_lib.load_adapter(lora, config)
            adapters = adapters_lib.single(config, adapter)
        self.engine = Engine(config, params, sampler, shardings=shardings, runtime=runtime, quantize=quantize,
                             compilation_cache=compilation_cache, batch_invariant=batch_invariant, adapters=adapters)
        self.config, self.params, self.tokenizer = config, self.engine.params, tokenizer

    @classmethod
    def from_pretrained(cls, checkpoint: str | None = None, dtype: str | None = None, sampler=None,
                        shardings=None, revision: str | None = None, runtime=None,
                        quantize: str | None = None, compilation_cache: bool | str = True, mesh=None,
                        rules: str | tuple = "latency", mirror: bool | None = None,
                        progress: bool = False, batch_invariant: bool | int = True, lora=None) -> "DiffusionGemma":
        """A ready model: checkpoint, tokenizer and engine, read from a directory, a store or the Hub.

        Args:
          checkpoint: a local directory, gs:// (any fsspec URL) or a Hub repo id[@revision]; None: the
            bundled model.
          dtype: parameter dtype (default: the checkpoint's). sampler: the `SamplerConfig` (default: the
            checkpoint's). revision: the Hub revision.
          shardings: `Shardings` built yourself (or give `mesh` and `rules`, not both).
          runtime: how the engine's programs run (`dgemma_jax.Runtime`; default: this backend).
          quantize: "int8" / "int4" quantizes the weights on load, "auto" picks none / int8 / int4 by the
            devices' memory, None or "none" keeps the checkpoint's dtype (`dgemma_jax.model.quant`).
          compilation_cache: jax's persistent compilation cache, as `Engine` takes it (default on).
          mesh, rules: a `jax.sharding.Mesh` or a spec ("expert=8") and a rule set: the weights are read
            straight into their shards and every program runs on the mesh.
          mirror: True: copy a gs:// (fsspec) checkpoint's weights into the local mirror (a Hub repo's
            into the Hugging Face cache) and read them from there, so that later starts skip the store;
            False: each process reads its shards' bytes straight from the store or the Hub; None (default):
            False, but a Hub repo read by a single process is downloaded (`locations.locate`).
          progress: show a bar while a Hugging Face checkpoint's tensors are read (and quantized).
          batch_invariant: `Engine`'s: True (default) a prompt with its seed gets the same text alone or in
            any list (float32 on a CPU: one batched program per list; elsewhere each prompt its own
            program); an int N the same text from blocks of exactly N rows (one compiled program for
            lists up to N; one prompt alone costs N rows); False one batched program without those
            guarantees (a row's text can change with the rest; the fastest).
          lora: a LoRA adapter (a `dgemma train` LoRA run's work directory or checkpoints/<step>), run
            unmerged beside the weights; None: the checkpoint alone.
        Returns:
          a `DiffusionGemma`.
        Raises:
          ValueError naming the problem (both mesh and shardings; a checkpoint that cannot be read).
        """
        if mesh is not None:
            if shardings is not None:
                raise ValueError("pass mesh (and rules) or shardings, not both")
            mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
        # quantized while loading, tensor by tensor (with `shardings` built by the caller: by the engine, after)
        on_load = quantize if shardings is None else None
        cfg, params, saved_sampler, tok = load_checkpoint(checkpoint, dtype, revision, mesh=mesh, rules=rules,
                                                        mirror=mirror, quantize=on_load, progress=progress)
        if mesh is not None:
            shardings = Shardings(cfg, mesh, rules)
        return cls(cfg, params, tok, sampler or saved_sampler, shardings, runtime,
                   quantize if shardings is not None and on_load is None else None, compilation_cache,
                   batch_invariant, lora)

    @property
    def sampler(self):
        return self.engine.sampler

    def encode_with_images(self, text: str, images, max_soft_tokens: int | None = None, add_bos: bool = True):
        """One prompt with images, each `<|image|>` in the text expanded to its soft tokens (`prompt_with_images`).

        Args:
          text: the prompt, one `<|image|>` placeholder per image (none: one per image at its start).
          images: one or a list (paths, bytes, PIL images or uint8 arrays), in the placeholders'
            order, or an `ImageBatch` already preprocessed for this checkpoint.
          max_soft_tokens: the vision budget per image (default: the processor's). add_bos: start with a BOS.
        Returns:
          (tokens [1, T] int32, lengths [1] int32, the `ImageBatch` the engine's `images=` takes).
        """
        return prompt_with_images(self.config, self.tokenizer, text, images, max_soft_tokens, add_bos)

    def encode_batch(self, texts: Sequence[str]):
        """Prompts as one right-padded batch, each with a BOS.

        Args:
          texts: the prompts (a non-empty sequence of strings).
        Returns:
          (tokens [B, T] int32, padded with `config.pad_id`; lengths [B] int32).
        """
        if not texts:
            raise ValueError("no prompts: pass a string or a non-empty list of strings")
        ids = [self.tokenizer.encode(t, add_bos=True) for t in texts]
        width = max(len(x) for x in ids)
        tokens = np.full((len(ids), width), self.config.pad_id, np.int32)
        for i, x in enumerate(ids):
            tokens[i, : len(x)] = x
        return tokens, np.array([len(x) for x in ids], np.int32)

    def generate(self, text: str | Sequence[str], max_new_tokens: int | None = None, seed: int | Sequence[int] = 0,
                 images=None, max_soft_tokens: int | None = None, suffix: str | Sequence[str] | None = None,
                 json_schema: Any = None, regex: str | None = None, response_format: dict | None = None,
                 **kw) -> Any:
        """Text in, text out.

        Args:
          text: one prompt, or a list of prompts.
          max_new_tokens: the budget (default DEFAULT_NEW_TOKENS, 256, capped to the whole canvases
            that fit after the longest prompt, as on the command line; a capped output that ends
            without an end of sequence is a DgemmaWarning).
          seed: one int (every prompt uses that seed's stream) or one int per prompt. A prompt with its
            seed gets the same text alone or in any list, at any position, given the same
            max_new_tokens (`Engine`'s batch_invariant: one batched program whose shapes do not
            change a row's numbers, or each prompt its own; tests/test_batch_invariance.py, XLA:CPU).
          images: for one prompt, an image or a list (paths, bytes, PIL images or uint8 arrays;
            `dgemma_jax.io.images`), placed at the `<|image|>` markers of `text` (or, without
            markers, before it).
          max_soft_tokens: the per-image token budget (default: the checkpoint's).
          suffix: infill: the text that follows the answer (one, or one per prompt). The answer is then
            the middle between the prompt and the suffix (`Engine.infill`: the suffix is pinned on the
            canvas after each candidate middle length, the most likely kept); prompt + answer + suffix
            is the whole text, and the suffix is not in the answer. max_new_tokens bounds the middle
            (default: one canvas); `kw` may hold `max_candidates` / `middle_lengths`.
          json_schema, regex, response_format: structured output (one of them): a JSON schema (a dict or
            its JSON text), a regex, or an OpenAI `response_format` ({"type": "json_object"} or
            {"type": "json_schema", "json_schema": {"schema": {...}}}). Every answer is valid under it
            (`Engine.generate_structured`), unless the budget runs out first: then a DgemmaWarning says
            so and the text is a valid prefix. A schema or regex that cannot be compiled is a ValueError.
            `constraint_decoder="prefix"` / `"dingo"` (in kw) picks how a regex's canvas is chosen
            (`Engine.generate_structured`).
          **kw: more `Engine.generate` arguments (cache_length, ...).
        Returns:
          the generated text (special tokens skipped), or a list of them for a list of prompts.
        Raises:
          errors.NonFiniteLogits: the model met NaN/Inf logits (not pad text).
        """
        single = isinstance(text, str)
        if suffix is not None:
            return self._infill(text, suffix, max_new_tokens, seed, images, kw)
        if json_schema is not None or regex is not None or response_format is not None:
            if images is not None or set(kw) - {"constraint_decoder"}:
                raise ValueError("structured output takes text prompts and max_new_tokens / seed / "
                                 "constraint_decoder only")
            return self._structured(text, self.grammar(json_schema=json_schema, regex=regex,
                                                       response_format=response_format), max_new_tokens, seed, **kw)
        if images is not None:
            if not single:
                raise ValueError("images go with one prompt: pass text as a string (batch prompts with images "
                                 "through Engine.generate)")
            tokens, lengths, batch = self.encode_with_images(text, images, max_soft_tokens)
            kw["images"] = batch
        else:
            tokens, lengths = self.encode_batch([text] if single else list(text))
        context = int(lengths.max())
        given = max_new_tokens is not None
        if not given:
            max_new_tokens = default_new_tokens(self.config, self.sampler, context, kw.get("cache_length"))
        out = self.engine.generate(tokens, lengths, rng=seed, max_new_tokens=max_new_tokens, nonfinite="raise", **kw)
        if not given:
            warn_if_cut_short(self.config, max_new_tokens, out.finished, context, kw.get("cache_length"))
        texts = [self.tokenizer.decode_generated(row, skip_special=True) for row in np.asarray(out.tokens)]
        return texts[0] if single else texts

    def grammar(self, json_schema: Any = None, regex: str | None = None, response_format: dict | None = None):
        """The compiled constraint of one of a JSON schema, a regex or an OpenAI `response_format`, for
        this checkpoint's tokenizer (compile once, pass to `engine.generate_structured` many times).

        Args:
          json_schema: a JSON schema (a dict or its JSON text); regex: a regex the whole answer matches;
            response_format: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}.
        Returns:
          an `engine.grammar.Grammar`.
        Raises:
          ValueError naming the problem (none or several given, a bad schema or regex, one the grammar
          library cannot compile)."""
        given = [x is not None for x in (json_schema, regex, response_format)]
        if sum(given) != 1:
            raise ValueError("give one of json_schema, regex or response_format")
        json_object = False
        if response_format is not None:
            json_schema, json_object = schema_of_response_format(response_format)
        return compile_grammar(self.tokenizer, self.config.vocab_size, self.sampler.eos_ids, json_schema=json_schema,
                               regex=regex, json_object=json_object)

    def _structured(self, text, grammar, max_new_tokens, seed, **decoder) -> Any:
        single = isinstance(text, str)
        tokens, lengths = self.encode_batch([text] if single else list(text))
        if max_new_tokens is None:
            max_new_tokens = default_new_tokens(self.config, self.sampler, int(lengths.max()))
        out = self.engine.generate_structured(tokens, lengths, grammars=grammar, rng=seed,
                                              max_new_tokens=max_new_tokens, nonfinite="raise", **decoder)
        if "length" in out.finish_reasons:
            warnings.warn(f"{out.finish_reasons.count('length')} answer(s) reached max_new_tokens={max_new_tokens} "
                          f"before the {grammar.kind} was complete: their text is a valid prefix only; raise "
                          "max_new_tokens", DgemmaWarning, stacklevel=3)
        texts = [self.tokenizer.decode(ids, skip_special=True) for ids in out.tokens]
        return texts[0] if single else texts

    def _infill(self, text, suffix, max_new_tokens, seed, images, kw) -> Any:
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        suffixes = [suffix] * len(texts) if isinstance(suffix, str) else list(suffix)
        if images is not None:
            raise ValueError("infill (suffix=) takes text prompts only, without images")
        if len(suffixes) != len(texts) or not all(isinstance(x, str) for x in suffixes):
            raise ValueError(f"suffix must be one string or one string per prompt ({len(texts)}); got {suffix!r}"[:300])
        ids = [self.tokenizer.encode(x) for x in suffixes]
        for x, i in zip(suffixes, ids):
            if not i:
                raise ValueError(f"suffix {x!r} has no tokens: give a non-empty suffix, or call generate without it")
        tokens, lengths = self.encode_batch(texts)
        out = self.engine.infill(tokens, lengths, suffixes=ids, rng=seed, max_new_tokens=max_new_tokens,
                                 nonfinite="raise", **kw)
        middles = [self.tokenizer.decode(m, skip_special=True) for m in out.middles]
        return middles[0] if single else middles

    def chat(self, messages: Sequence[dict], max_new_tokens: int | None = None, enable_thinking: bool = False,
             seed: int = 0, max_soft_tokens: int | None = None) -> str:
        """The assistant's answer to a chat history (`io.prompts.chat_prompt` builds the prompt).

        Args:
          messages: `{"role", "content"}` dicts; content a string or parts, `{"type": "text", "text"}`
            and `{"type": "image", "image" | "path": ...}` (a checkpoint with a vision tower). A
            tokenizer without a chat template (the bundled models' characters) answers the last
            message alone, its text parts joined (as the server does), its images placed as in `generate`.
          max_new_tokens: the budget (default: as `generate`'s, capped to what fits after the prompt).
          enable_thinking: render the generation prompt with thinking on.
          seed: the answer's seed. max_soft_tokens: each image's budget (default: the checkpoint's).
        Returns:
          the answer text, its thinking stripped.
        Raises:
          errors.NonFiniteLogits: the model met NaN/Inf logits.
        """
        ids, batch = chat_prompt(self.config, self.tokenizer, list(messages), thinking=enable_thinking,
                                 max_soft_tokens=max_soft_tokens)
        given = max_new_tokens is not None
        if not given:
            max_new_tokens = default_new_tokens(self.config, self.sampler, len(ids))
        out = self.engine.generate(np.array([ids], np.int32), None, rng=seed, max_new_tokens=max_new_tokens,
                                   images=batch, nonfinite="raise")
        if not given:
            warn_if_cut_short(self.config, max_new_tokens, out.finished, len(ids))
        gen = [int(t) for t in np.asarray(out.tokens)[0] if int(t) != self.sampler.pad_id]
        return split_reply(self.tokenizer, gen)[1]
