"""The exercise grader: a correct hand-in passes, a wrong one and the untouched stub fail clearly."""
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent / "exercise_solutions"


def grade(*args):
    return subprocess.run([sys.executable, "-m", "minitrain.exercises", *args],
                          capture_output=True, text=True, timeout=300)


def test_a_correct_ring_passes():
    result = grade("check", "ring_all_reduce", str(HERE / "ring_all_reduce_learner.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 passed, 0 failed" in result.stdout


def test_the_library_passes_its_own_exercise():
    assert grade("check", "ring_all_reduce", "--reference").returncode == 0


def test_all_to_all_exchange_is_exact_but_fails_the_bandwidth_bound():
    result = grade("check", "ring_all_reduce", str(HERE / "ring_all_reduce_naive.py"))
    assert result.returncode == 1
    assert "PASS  p=4: exact" in result.stdout
    assert "FAIL  p=4: bytes sent within the ring's bound" in result.stdout


def test_the_stub_fails_with_its_own_message(tmp_path):
    stub = tmp_path / "mine.py"
    assert grade("stub", "ring_all_reduce", str(stub)).returncode == 0
    result = grade("check", "ring_all_reduce", str(stub))
    assert result.returncode == 1
    assert "NotImplementedError: ring_all_reduce: write the reduce-scatter" in result.stdout


def test_a_correct_1f1b_passes_and_the_library_too():
    result = grade("check", "one_f_one_b", str(HERE / "one_f_one_b_learner.py"))
    assert result.returncode == 0 and "12 passed, 0 failed" in result.stdout, result.stdout + result.stderr
    assert grade("check", "one_f_one_b", "--reference").returncode == 0


def test_gpipe_handed_in_as_1f1b_fails_the_memory_bound(tmp_path):
    result = grade("check", "one_f_one_b", str(HERE / "one_f_one_b_gpipe.py"))
    assert result.returncode == 1
    assert "PASS  p=4: bubble" in result.stdout and "FAIL  p=4: in flight <= min(p-s, m)" in result.stdout
    stub = tmp_path / "mine.py"
    assert grade("stub", "one_f_one_b", str(stub)).returncode == 0
    result = grade("check", "one_f_one_b", str(stub))
    assert "NotImplementedError: one_f_one_b: write the warm-up" in result.stdout


def test_megatron_f_g_grades_forward_and_gradients():
    result = grade("check", "megatron_f_g", str(HERE / "megatron_f_g_learner.py"))
    assert result.returncode == 0 and "12 passed, 0 failed" in result.stdout, result.stdout + result.stderr
    assert grade("check", "megatron_f_g", "--reference").returncode == 0
    wrong = grade("check", "megatron_f_g", str(HERE / "megatron_f_g_swapped.py"))
    assert wrong.returncode == 1
    assert "PASS  t=2: forward" in wrong.stdout and "FAIL  t=2: input gradient" in wrong.stdout
    assert "PASS  t=1: input gradient" in wrong.stdout        # one rank: nothing to sum


def test_the_megatron_stub_fails_with_its_own_message(tmp_path):
    stub = tmp_path / "mine.py"
    assert grade("stub", "megatron_f_g", str(stub)).returncode == 0
    assert "NotImplementedError: megatron_f_g: write f's forward" in grade("check", "megatron_f_g", str(stub)).stdout
