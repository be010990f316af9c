import pytest

from tests.harness import Run, triton_env


@pytest.fixture
def orch_run(tmp_path):
    """Factory for real daemon runs; every run is torn down and checked for leaks."""
    if triton_env() is None:
        pytest.skip("no .triton/env: run scripts/setup-triton (the README's test command does)")
    runs: list[Run] = []

    def make(**kwargs) -> Run:
        run = Run(tmp_path / f"run{len(runs)}", **kwargs)
        (tmp_path / f"run{len(runs)}").mkdir(exist_ok=True)
        runs.append(run)
        return run

    yield make
    leaks = {str(r.state_dir): r.close() for r in runs}
    assert not any(leaks.values()), f"processes left running after the test: {leaks}"
