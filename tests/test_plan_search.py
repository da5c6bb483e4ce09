"""The search's shortcuts never change an answer: plan/memory.py's pipeline_stages and plan/walks.py's _step_end
are cached across layouts, so a layout predicted after others equals it predicted with those caches empty, for
layouts that differ in one field each of what the caches read (were a field missing from a key, the second of
a pair would get the first's answer)."""
from minitrain import plan
from minitrain.plan.memory import pipeline_stages, predict_memory
from minitrain.plan.search import search
from minitrain.plan.walks import _step_end

MODEL = plan.GPT(vocab_size=65, block_size=32, n_layer=8, n_head=4, n_embd=64)
BASE = dict(world=2, pp=2, batch_size=10, microbatches=5, precision="bf16")
CASES = {name: (MODEL, plan.Layout(**{**BASE, **fields})) for name, fields in {
    "1f1b": {}, "gpipe": dict(schedule="gpipe"), "fp32": dict(precision="fp32"), "sgd": dict(optimizer="sgd"),
    "pp 4": dict(world=4, pp=4),                                    # the same pieces as pp 2
    "m 3": dict(world=4, pp=4, batch_size=5, microbatches=3),       # both b = 2
    "m 4": dict(world=4, pp=4, batch_size=5, microbatches=4),
    "v 2": dict(schedule="interleaved_1f1b", chunks=2, batch_size=8, microbatches=4),
    "v 4": dict(schedule="interleaved_1f1b", chunks=4, batch_size=8, microbatches=4),
    **{f"zero {z}": dict(world=4, dp=2, batch_size=20, zero=z) for z in range(4)},
    "zero 1 offload": dict(world=4, dp=2, batch_size=20, zero=1, offload=True),
    "zero 2 dp 4": dict(world=8, dp=4, batch_size=40, zero=2)}.items()}
# two models whose first of 3 stages is alike (its layers, its micro-batches in flight) but for the other stages'
# parameters, which it holds as placeholders
CASES.update({f"{n} layers": (plan.GPT(vocab_size=65, block_size=32, n_layer=n, n_head=4, n_embd=64),
                              plan.Layout(world=3, pp=3, batch_size=3, microbatches=3, precision="bf16"))
              for n in (2, 3)})


def alone(predict, *args):
    """``predict(*args)`` with the search's caches emptied first."""
    pipeline_stages.cache_clear()
    _step_end.cache_clear()
    return predict(*args)


def test_a_layout_predicted_after_others_equals_it_predicted_alone():
    for model, layout in CASES.values():
        plan.check(model, layout)
    cold = {name: alone(predict_memory, *case) for name, case in CASES.items()}
    assert len({repr(memory) for memory in cold.values()}) == len(CASES)        # each pair differs
    for name, case in CASES.items():                                            # each after the others
        assert predict_memory(*case) == cold[name], name


def test_the_search_ranks_what_each_layout_predicts_alone():
    machine = plan.load_machine("a100-80gb")
    ranked = search(MODEL, plan.Layout(world=4, batch_size=8, precision="bf16"), machine, "minitrain", None)
    assert len(ranked) > 50 and {r["layout"]["zero"] for r in ranked} == {0, 1, 2, 3}
    for r in ranked:
        layout = plan.Layout(**{k: v for k, v in r["layout"].items() if k != "micro_batch_size"})
        assert alone(plan.predict, MODEL, layout, machine, "minitrain", None, False, False) == r
