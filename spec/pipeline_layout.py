"""Which decoder layers each pipeline rank holds: the one placement the executor builds and the
cost model and Megatron arguments describe.

The placement is one per-stage, per-virtual-chunk assignment of decoder layers (:func:`layer_chunks`),
derived from Megatron-LM's pipeline options, which :class:`PipelineSplit` carries:

- none of them (foldtune's default): ``pp·vpp`` consecutive chunks whose sizes differ by at most one, the
  extra layers on the earliest chunks (Megatron gets the cut as a layout string when it is uneven);
- ``--pipeline-model-parallel-layout``: an explicit string (``E`` embedding, ``t`` decoder layer, ``m`` MTP
  layer, ``L`` loss, ``|`` between chunks, ``x*n`` and ``(...)*n`` repeat, commas are cosmetic), its chunks
  listed in Megatron's flattened order (chunk ``j`` is virtual stage ``j // pp`` of rank ``j % pp``), so the
  string fixes ``pp·vpp``;
- ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``: the first / last rank
  hold that many layers and the ranks between share the rest evenly;
- ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``: the embedding
  (loss) counts as one layer of the even split, so the model's first (last) chunk holds one decoder layer
  fewer; 94 layers with both on pp32·vpp3 give every chunk one slot: the first holds only the embedding,
  the last only the loss.

With the Megatron options every rank's layer count must split evenly over its ``vpp`` chunks, as Megatron's
``get_num_layers_to_build`` demands (read, not copied, at NVIDIA/Megatron-LM main, 2026). The embedding is
always on the model's first chunk and the loss (with the MTP layers: foldtune does not place MTP on a rank
of its own) on the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from spec.errors import InvalidConfigError

MAX_LAYOUT_CHARS = 4096  # the layout string a user may send
MAX_EXPANDED_ITEMS = 1 << 16  # its expansion ('(t|)*99999999' must not allocate gigabytes)
LAYOUT_SYMBOLS = "EtmL"


class PipelineLayoutError(InvalidConfigError):
    """A pipeline layout option that cannot be read or does not fit the model / pp / vpp; ``reason`` is
    the readable line (without the option's name), for a validity Rejection."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def canonical_layout(text: str) -> str:
    """The layout string without its cosmetic commas and whitespace (the form labels and caches use)."""
    return "".join(ch for ch in text if ch not in ", \t\n")


def _expand(text: str, pos: int, depth: int) -> tuple[list[str], int]:
    """Symbols and '|' of ``text`` from ``pos`` to the matching ')' (or the end), repeats unrolled."""
    out: list[str] = []
    while pos < len(text):
        ch = text[pos]
        if ch == ")":
            if depth == 0:
                raise PipelineLayoutError(f"unbalanced ')' at position {pos}")
            return out, pos + 1
        if ch == "(":
            if depth >= 8:
                raise PipelineLayoutError("parentheses nested more than 8 deep")
            unit, pos = _expand(text, pos + 1, depth + 1)
            if pos > len(text) or text[pos - 1] != ")":
                raise PipelineLayoutError("unbalanced '('")
        elif ch in LAYOUT_SYMBOLS or ch == "|":
            unit, pos = [ch], pos + 1
        else:
            raise PipelineLayoutError(f"unknown symbol {ch!r} at position {pos} (known: E t m L | ( ) * and digits)")
        if pos < len(text) and text[pos] == "*":
            end = pos + 1
            while end < len(text) and text[end].isdigit():
                end += 1
            if end == pos + 1:
                raise PipelineLayoutError(f"'*' at position {pos} is not followed by a count")
            count = int(text[pos + 1:end])
            if len(unit) * count + len(out) > MAX_EXPANDED_ITEMS:
                raise PipelineLayoutError(f"expands to more than {MAX_EXPANDED_ITEMS} symbols")
            unit, pos = unit * count, end
        out += unit
        if len(out) > MAX_EXPANDED_ITEMS:
            raise PipelineLayoutError(f"expands to more than {MAX_EXPANDED_ITEMS} symbols")
    if depth:
        raise PipelineLayoutError("unbalanced '('")
    return out, pos


@lru_cache(maxsize=256)
def parse_layout_string(text: str) -> tuple[str, ...]:
    """The chunks of a Megatron layout string in flattened order, each as its symbols ('Ettt', '', 'mL')."""
    if len(text) > MAX_LAYOUT_CHARS:
        raise PipelineLayoutError(f"is longer than {MAX_LAYOUT_CHARS} characters")
    symbols, _ = _expand(canonical_layout(text), 0, 0)
    return tuple("".join(symbols).split("|"))


@dataclass(frozen=True)
class PipelineSplit:
    """Megatron's options that place decoder layers on pipeline chunks (None / False: not given).

    Hashable: the cost model caches stage layouts on (pp, vpp, split).
    """

    layout: str | None = None
    first: int | None = None  # --decoder-first-pipeline-num-layers
    last: int | None = None  # --decoder-last-pipeline-num-layers
    embedding: bool = False  # --account-for-embedding-in-pipeline-split
    loss: bool = False  # --account-for-loss-in-pipeline-split

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_SPLIT

    def problems(self) -> list[str]:
        """What is wrong with the options on their own (no model needed): Megatron's exclusions."""
        p = []
        if self.layout is not None:
            try:
                parse_layout_string(self.layout)
            except PipelineLayoutError as exc:
                p.append(f"pipeline_layout {self.layout[:80]!r}: {exc.reason}")
            if self.first is not None or self.last is not None or self.embedding or self.loss:
                p.append("pipeline_layout places every layer itself: it excludes decoder_first/last_pipeline_"
                         "num_layers and account_for_embedding/loss_in_pipeline_split")
        for name, value in (("decoder_first_pipeline_num_layers", self.first),
                            ("decoder_last_pipeline_num_layers", self.last)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                p.append(f"{name} must be an integer >= 0, got {value!r}")
        if (self.first is not None or self.last is not None) and (self.embedding or self.loss):
            p.append("decoder_first/last_pipeline_num_layers exclude account_for_embedding/loss_in_pipeline_split "
                     "(as in Megatron-LM)")
        return p

    def num_chunks(self) -> int | None:
        """pp·vpp as the layout string fixes it, or None without a layout string."""
        return len(parse_layout_string(self.layout)) if self.layout is not None else None


DEFAULT_SPLIT = PipelineSplit()


@lru_cache(maxsize=4096)
def chunk_sizes(num_layers: int, pp: int, vpp: int, split: PipelineSplit = DEFAULT_SPLIT,
                mtp_num_layers: int = 0) -> tuple[int, ...]:
    """Decoder layers of every chunk in Megatron's flattened order (chunk ``j``: rank ``j % pp``, virtual
    stage ``j // pp``); raises :class:`PipelineLayoutError` when Megatron's options do not fit. Without
    options it always answers (empty last chunks when there are fewer layers than chunks: see
    :func:`check_placement`)."""
    chunks = pp * vpp
    if split.layout is not None:
        parts = parse_layout_string(split.layout)
        if len(parts) != chunks:
            raise PipelineLayoutError(f"the layout has {len(parts)} chunks, pp·vpp = {pp}·{vpp} = {chunks}")
        flat = "".join(parts)
        decoders = flat.count("t")
        if decoders != num_layers:
            raise PipelineLayoutError(f"the layout places {decoders} decoder layers ('t'), the model has {num_layers}")
        if not parts[0].startswith("E") or flat.count("E") != 1:
            raise PipelineLayoutError("the embedding 'E' must open the first chunk, once")
        if not parts[-1].endswith("L") or flat.count("L") != 1:
            raise PipelineLayoutError("the loss 'L' must close the last chunk, once")
        mtp = flat.count("m")
        if mtp != mtp_num_layers:
            raise PipelineLayoutError(f"the layout places {mtp} MTP layers ('m'), the model has {mtp_num_layers}")
        if mtp and not parts[-1].endswith("m" * mtp + "L"):
            raise PipelineLayoutError("MTP layers 'm' must directly precede the loss in the last chunk (foldtune "
                                      "runs and prices MTP with the loss, not on a stage of its own)")
        return tuple(part.count("t") for part in parts)
    if split.first is not None or split.last is not None:
        if pp < 2:
            raise PipelineLayoutError("decoder_first/last_pipeline_num_layers need pp > 1")
        rest, middle = num_layers, pp
        for value in (split.first, split.last):
            if value is not None:
                rest, middle = rest - value, middle - 1
        if rest < 0:
            raise PipelineLayoutError(f"first/last stage layers ({split.first}, {split.last}) exceed num_layers "
                                      f"({num_layers})")
        if middle == 0 and rest:
            raise PipelineLayoutError(f"first + last stage layers must be num_layers ({num_layers}) with pp 2")
        if middle and rest % middle:
            raise PipelineLayoutError(f"the {rest} layers left after the first/last stages do not split evenly "
                                      f"over the {middle} middle stages")
        per_rank = [rest // middle if middle else 0] * pp
        if split.first is not None:
            per_rank[0] = split.first
        if split.last is not None:
            per_rank[-1] = split.last
        for rank, n in enumerate(per_rank):
            if n % vpp:
                raise PipelineLayoutError(f"pipeline rank {rank} holds {n} layers, not a multiple of vpp ({vpp})")
        return tuple(per_rank[j % pp] // vpp for j in range(chunks))
    if split.embedding or split.loss:
        slots = num_layers + int(split.embedding) + int(split.loss)
        if slots % chunks:
            raise PipelineLayoutError(f"num_layers ({num_layers}) + {int(split.embedding)} (embedding) + "
                                      f"{int(split.loss)} (loss) = {slots} is not divisible by pp·vpp = "
                                      f"{pp}·{vpp} = {chunks}")
        sizes = [slots // chunks] * chunks
        sizes[0] -= int(split.embedding)
        sizes[-1] -= int(split.loss)
        if min(sizes) < 0:
            raise PipelineLayoutError("a chunk holding the embedding or the loss has no slot left for them")
        return tuple(sizes)
    # fewer layers than chunks leaves the last chunks empty here; the validity rule (layers_pp) refuses it
    base, extra = divmod(num_layers, chunks)
    return tuple(base + (1 if j < extra else 0) for j in range(chunks))


def check_placement(num_layers: int, pp: int, vpp: int, split: PipelineSplit = DEFAULT_SPLIT,
                    mtp_num_layers: int = 0) -> tuple[int, ...]:
    """:func:`chunk_sizes`, also refusing the default split with fewer layers than chunks (Megatron's rule:
    without placement options every chunk holds a decoder layer)."""
    if split.is_default and num_layers < pp * vpp:
        raise PipelineLayoutError(f"num_layers ({num_layers}) is smaller than pp·vpp = {pp}·{vpp} = {pp * vpp} "
                                  f"pipeline chunks")
    return chunk_sizes(num_layers, pp, vpp, split, mtp_num_layers)


@lru_cache(maxsize=4096)
def layer_chunks(num_layers: int, pp: int, vpp: int,
                 split: PipelineSplit = DEFAULT_SPLIT) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Decoder-layer indices of every pipeline rank, one tuple per virtual chunk: ``[stage][chunk]``.

    The model is cut into ``pp·vpp`` consecutive chunks of :func:`chunk_sizes` layers (by default chunk
    ``j`` holds ``L // (pp·vpp)`` layers plus one more when ``j < L % (pp·vpp)``). Pipeline rank ``i`` runs
    chunks ``i, i + pp, i + 2·pp, ...`` (Megatron's interleaved order). MTP layers are not counted here.
    """
    sizes = chunk_sizes(num_layers, pp, vpp, split, _mtp_of(split))
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return tuple(
        tuple(tuple(range(bounds[v * pp + i], bounds[v * pp + i + 1])) for v in range(vpp))
        for i in range(pp)
    )


def _mtp_of(split: PipelineSplit) -> int:
    """The MTP layers a layout string places (the model's count is checked by the validity rules)."""
    return "".join(parse_layout_string(split.layout)).count("m") if split.layout is not None else 0


def format_layout(sizes: tuple[int, ...] | list[int], mtp_num_layers: int = 0) -> str:
    """A Megatron layout string for chunks of ``sizes`` decoder layers (flattened order): the embedding opens
    the first chunk, MTP layers and the loss close the last, runs of equal chunks fold as ``(x|)*n``."""
    parts = [f"t*{n}" if n > 1 else "t" * n for n in sizes]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "m" * mtp_num_layers + "L"
    out = []
    i = 0
    while i < len(parts):
        run = 1
        while i + run < len(parts) and parts[i + run] == parts[i]:
            run += 1
        out.append(f"({parts[i]}|)*{run}" if run > 1 else parts[i] + "|")
        i += run
    return "".join(out)[:-1]
