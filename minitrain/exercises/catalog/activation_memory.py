"""Grader: the activation bytes one transformer layer keeps for backward, as Korthikanti et al. (2022)
count them (Section 4.1, Table 2): 16-bit values, 1-byte dropout masks; tensor parallelism, sequence
parallelism, selective and full recomputation. Every row for GPT-3 175B, notebook 10's 2.7B GPT and odd
small sizes, t = 1 to 8, == minitrain.plan.korthikanti_layer_bytes; Table 2's GPT-3 numbers and what
they say; an unknown recompute mode refused. A wrong total is read back in units of sbh and as²b, and
the usual slips (2-byte masks, everything divided by t without SP, the scores not split, ...) named."""
import math

from ...backend import is_real
from ..grading import Check, Mismatch

TITLE = "activation memory per transformer layer: Korthikanti et al.'s Table 2 from its pieces, under TP, SP, recompute"
ORDER = 172
KIND = "implement"
NOTEBOOK = "10_planner"
DEFINES = "layer_activation_bytes"

STUB = '''"""Exercise activation_memory: how many bytes one transformer layer keeps for its backward pass, as
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Section 4,
Table 2) count them. The planner's --accounting paper adds these up, layer by layer and micro-batch
by micro-batch in flight, to say whether a model fits.

A GPT layer: LayerNorm, attention (the QKV linear, QK^T, softmax, dropout, attention over V, the
output projection, dropout), the residual, LayerNorm, MLP (h -> 4h linear, GeLU, 4h -> h linear,
dropout), the residual. s is the sequence length, b the micro-batch size, h the hidden size, a the
number of heads. Values are 16-bit (2 bytes an element); a dropout mask is 1 byte an element. What
backward needs (Section 4.1):

  attention  the QKV linear's input 2sbh; Q and K (for QK^T) 4sbh; softmax's output 2as²b; its
             dropout mask as²b; attention over V: the dropout's output 2as²b and V 2sbh; the
             output projection's input 2sbh; the dropout mask after it sbh      = 11sbh + 5as²b
  MLP        the first linear's input 2sbh; GeLU's input 8sbh; the second linear's input 8sbh;
             the dropout mask after it sbh                                      = 19sbh
  LayerNorm  each of the two keeps its input 2sbh                               = 4sbh
  in all     34sbh + 5as²b = sbh(34 + 5as/h)

Write layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"): the bytes
one rank keeps for one layer (a number; a float is fine, the formulas divide).
  - t-way tensor parallelism (Megatron) splits what lies between its f and g over the t ranks: Q, K,
    V, the scores and everything s² after them, the projection's input; the MLP's two 4h-wide
    tensors. The rest, 10sbh (both LayerNorms' inputs, the attention's and the MLP's inputs, the
    two dropout masks after them), is the same on every rank;
  - sequence_parallel=True splits those 10sbh along the sequence over the same t ranks;
  - recompute="selective" recomputes the s² pieces in backward (softmax, its mask, its dropout:
    cheap to redo, large to keep) instead of keeping them; "full" keeps only the layer's input
    (split along the sequence with SP) and recomputes the rest; "none" keeps everything; any other
    mode: raise ValueError.

The test to pass: Table 2 exactly, sbh(34 + 5as/h) alone, sbh(10 + 24/t + 5as/(ht)) with TP,
sbh/t(34 + 5as/h) with TP + SP, sbh(10 + 24/t) with selective recomputation (34sbh/t with SP), 2sbh
with full (2sbh/t with SP), for GPT-3 175B (s = 2048, h = 12288, a = 96) and small odd sizes at
t = 1 to 8; t = 1 gives the plain row whatever the rest; recompute="partial" raises ValueError.

Check it:  python -m minitrain.exercises check activation_memory mine.py
Stuck?     python -m minitrain.exercises hint activation_memory
"""


def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
    raise NotImplementedError("layer_activation_bytes: add up the pieces, split by t what TP (and SP) split")
'''

HINTS = (
    "Count in two units, sbh and as²b (a·s·s·b, one score per head and pair of positions), then add: attention "
    "2 + 4 + 2 + 2 + 1 = 11sbh plus 2 + 1 + 2 = 5as²b, the MLP 2 + 8 + 8 + 1 = 19sbh, the LayerNorms 4sbh. A "
    "dropout mask is 1 byte an element (as²b for the softmax's, sbh for each of the other two), everything "
    "else 2. 5as²b is sbh times 5as/h: for GPT-3 that is 80 sbh of the 114.",
    "Sort the pieces into the replicated and the split. Replicated under TP: the two LayerNorms' inputs (4sbh), "
    "the QKV linear's and the first MLP linear's inputs (2sbh each), the masks after the projection and the MLP "
    "(sbh each): 10sbh. Split by t: 24sbh + 5as²b. TP alone: replicated + split / t. TP + SP: (replicated + "
    "split) / t. Dividing the whole sum by t without SP is the slip: those 10sbh stay whole on every rank.",
    "sbh, scores = s * b * h, 5 * a * s * s * b; replicated, split = 10 * sbh, 24 * sbh + scores. Refuse a mode "
    "not in (\"none\", \"selective\", \"full\") with ValueError. full: return 2 * sbh (the layer's 16-bit input), "
    "/ t with SP. selective: split -= scores. Then (replicated + split) / t with SP, replicated + split / t "
    "without.",
)

SIZES = ((2048, 1, 12288, 96, "GPT-3 175B"), (2048, 8, 2560, 32, "notebook 10's 2.7B GPT"), (7, 3, 12, 6, ""),
         (5, 2, 24, 4, ""), (1, 1, 8, 2, ""), (33, 4, 48, 12, ""))        # (s, b, h, a, name)
TS = (1, 2, 3, 4, 8)
FORMULA = {("none", False): "sbh(10 + 24/t + 5as/(ht))", ("none", True): "sbh/t(34 + 5as/h)",
           ("selective", False): "sbh(10 + 24/t)", ("selective", True): "34sbh/t",
           ("full", False): "2sbh", ("full", True): "2sbh/t"}
# Table 2 for GPT-3 175B at t = 8, b = 1 (tests/test_plan.py, docs/measured.md): (recompute, sp, t, bytes)
GPT3 = (("none", False, 1, 2_868_903_936), ("none", False, 8, 578_813_952), ("none", True, 8, 358_612_992),
        ("selective", False, 8, 327_155_712), ("selective", True, 8, 106_954_752), ("full", False, 8, 50_331_648))
REPLICATED = ("without sequence parallelism the 10sbh outside f and g (both LayerNorms' inputs, the QKV and first "
              "MLP linears' inputs, the dropout masks after the projection and the MLP) stay whole on every rank: "
              "sbh(10 + 24/t), not 34sbh/t")


def korthikanti_layer_bytes(*args, **kwargs):
    """minitrain.plan's Table 2, imported when a check first needs it (list and show need no planner)."""
    from ...plan.papers import korthikanti_layer_bytes as table_2
    return table_2(*args, **kwargs)


def _slips(s, b, h, a, t, sp, rc):
    """(what went wrong, the bytes that slip gives) for this case."""
    sbh, scores = s * b * h, a * s * s * b
    d = t if sp else 1                                     # what the replicated part is divided by

    def k(**change):
        args = dict(s=s, b=b, h=h, a=a, t=t, sequence_parallel=sp, recompute=rc)
        return korthikanti_layer_bytes(**{**args, **change})
    if rc != "full":
        masks = (scores if rc == "none" else 0) / t + 2 * sbh / d
        yield ("the dropout masks counted as 2 bytes an element: a mask is 1 byte (as²b for the softmax's, sbh for "
               "each of the two after the projection and the MLP), only the values are 16-bit", k() + masks)
        yield "the two LayerNorms' inputs (2sbh each) left out", k() - 4 * sbh / d
    if t > 1 and not sp:
        yield "everything divided by t: " + REPLICATED, k(sequence_parallel=True)
    if t > 1 and sp:
        yield ("sequence_parallel ignored: " + ("with SP each rank keeps only its s/t positions of the layer's input, "
                                                "2sbh/t" if rc == "full" else "with SP the 10sbh tensor parallelism "
                                                "leaves whole are split along the sequence too, so every piece is / t"),
               k(sequence_parallel=False))
    if t > 1 and rc == "none":
        yield ("the s² terms (5as²b = sbh·5as/h) not divided by t: each rank computes a/t of the heads, so it "
               "keeps a/t heads' scores: 5as²b/t", k() + 5 * scores * (1 - 1 / t))
    if rc == "selective":
        yield ("recompute='selective' kept the s² pieces: selective recomputation redoes softmax, its dropout "
               "mask and its output in backward, so the 5as²b of them is not kept (Q, K and V are)",
               k(recompute="none"))
        yield ("Q and K recomputed too: selective recomputation starts from them (QK^T is redone from Q and K), so "
               "they are kept, 4sbh split by t", k() - 4 * sbh / t)
    if rc == "full":
        yield "recompute='full' ignored: full recomputation keeps only the layer's input", k(recompute="none")
        yield ("full recomputation keeping sbh: the layer's input is a 16-bit value, 2 bytes an element, "
               "2sbh" + ("/t with SP" if sp else ""), k() / 2)
    if b > 1:
        yield "the micro-batch size b left out (every piece holds b sequences)", k(b=1)


def _bytes(impl, s, b, h, a, t, sp, rc, name=""):
    call = f"layer_activation_bytes(s={s}, b={b}, h={h}, a={a}, t={t}, sequence_parallel={sp}, recompute={rc!r})"
    got = impl(s, b, h, a, t=t, sequence_parallel=sp, recompute=rc)
    if not is_real(got):
        raise Mismatch(f"{call}: returned {type(got).__name__} {got!r:.60}, expected a number of bytes")
    want = korthikanti_layer_bytes(s, b, h, a, t, sp, rc)
    if math.isclose(got, want, rel_tol=1e-9):
        return got
    sbh, scores = s * b * h, a * s * s * b
    slips = [why for why, bytes_ in _slips(s, b, h, a, t, sp, rc) if math.isclose(got, bytes_, rel_tol=1e-9)]
    off = got - want
    why = (": " + "; or ".join(slips) if slips else f"; off by {off / sbh:+.6g} sbh = {off / scores:+.6g} as²b: which "
           "piece, and is it split by t?")
    formula = {"none": "sbh(34 + 5as/h)", "selective": "34sbh", "full": "2sbh"}[rc] if t == 1 else FORMULA[rc, sp]
    raise Mismatch(f"{call}{f' ({name})' if name else ''}: got {_n(got)} bytes = {got / sbh:.6g} sbh, expected "
                   f"{_n(want)} = {want / sbh:.6g} sbh, {formula} with sbh = {sbh:,}, as/h = {a * s / h:g}, t = {t}"
                   f"{why}")


def _n(x):
    return f"{x:,.0f}" if x == round(x) else f"{x:,.2f}"


def _each(impl, rc, sp, ts):
    for s, b, h, a, name in SIZES:
        for t in ts:
            if a % t == 0 and h % t == 0:                  # Megatron splits heads and columns evenly
                _bytes(impl, s, b, h, a, t, sp, rc, name)


def _plain(impl):
    _each(impl, "none", False, (1,))


def _tensor_parallel(impl):
    _each(impl, "none", False, TS[1:])


def _sequence_parallel(impl):
    _each(impl, "none", True, TS)


def _selective(impl):
    for sp in (False, True):
        _each(impl, "selective", sp, TS)


def _full(impl):
    for sp in (False, True):
        _each(impl, "full", sp, TS)


def _table_2(impl):
    """GPT-3 175B's rows, then the claims they make, stated as the paper's arithmetic."""
    s, b, h, a = 2048, 1, 12288, 96
    got = {}
    for rc, sp, t, want in GPT3:
        got[rc, sp, t] = _bytes(impl, s, b, h, a, t, sp, rc, "GPT-3 175B")
        if not math.isclose(got[rc, sp, t], want, rel_tol=1e-9):       # a grader's own slip, not the learner's
            raise Mismatch(f"GPT-3 175B, recompute={rc!r}, sp={sp}, t={t}: {got[rc, sp, t]:,.0f} bytes, Table 2 "
                           f"says {want:,}")
    sbh = s * b * h
    claims = [("at t = 1 selective recomputation removes 5as/h = 80 of the 114 sbh (70%)",
               math.isclose(_bytes(impl, s, b, h, a, 1, False, "selective"), 34 * sbh, rel_tol=1e-9)),
              ("SP and selective recomputation together keep 5.4x less than TP alone (578.8 -> 107.0 MB a layer)",
               math.isclose(got["none", False, 8] / got["selective", True, 8], 578_813_952 / 106_954_752)),
              ("at t = 1 SP changes nothing", all(math.isclose(_bytes(impl, s, b, h, a, 1, True, rc),
                                                               _bytes(impl, s, b, h, a, 1, False, rc), rel_tol=1e-9)
                                                  for rc in ("none", "selective", "full")))]
    for claim, holds in claims:
        if not holds:
            raise Mismatch(f"GPT-3 175B: expected {claim}")


def _unknown_mode(impl):
    for mode in ("partial", "attention", "recompute"):
        call = f"layer_activation_bytes(s=8, b=1, h=16, a=2, recompute={mode!r})"
        try:
            got = impl(8, 1, 16, 2, recompute=mode)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as e:
            raise Mismatch(f"{call} raised {type(e).__name__}: {e}; expected ValueError, the contract's refusal"
                           + (" (a dict's KeyError says less about what was wrong)" if isinstance(e, KeyError) else
                              "")) from None
        raise Mismatch(f"{call} returned {got!r:.40}; expected ValueError: recompute is one of 'none', 'selective', "
                       "'full', and a typo counted as one of them would plan a model that does not fit")


def checks():
    return [Check("no parallelism: sbh(34 + 5as/h), attention 11sbh + 5as²b, MLP 19sbh, LayerNorms 4sbh", _plain, 1),
            Check("tensor parallel: sbh(10 + 24/t + 5as/(ht)), the 10sbh outside f and g not split", _tensor_parallel,
                  2),
            Check("tensor + sequence parallel: sbh/t(34 + 5as/h), t = 1 the plain row", _sequence_parallel, 2),
            Check("selective recomputation: sbh(10 + 24/t), 34sbh/t with SP (the 5as²b recomputed)", _selective, 3),
            Check("full recomputation: the layer's 16-bit input, 2sbh, 2sbh/t with SP", _full, 3),
            Check("Table 2 for GPT-3 175B at t = 8 (2.869 GB alone, 578.8 MB TP ... 50.3 MB full) and its claims",
                  _table_2, 2),
            Check("an unknown recompute mode raises ValueError", _unknown_mode, 3)]


def reference():
    """minitrain.plan.korthikanti_layer_bytes, refusing an unknown mode (the planner's Layout refuses it)."""
    def layer_activation_bytes(s, b, h, a, t=1, sequence_parallel=False, recompute="none"):
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
        return korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel, recompute)
    return layer_activation_bytes
