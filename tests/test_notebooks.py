"""Every notebook in notebooks/ executes top to bottom on the zoo (nbclient, a real kernel), stored without
outputs; and the calibration widget's controls change what it shows."""
import time
from pathlib import Path

import nbformat
import pytest

from speclab.zoo import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_six_walkthroughs():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


# One notebook's budget, kernel start to last cell. The file took 87 s on a quiet 2-core machine and 687 s inside a
# long run on a loaded one; its heavy cells (02's bench, 03's calibration: every method over a suite) slow down with
# the load, and at that rate one of them alone comes near the 600 s that were both nbclient's limit per cell and
# pytest-timeout's per test (pyproject.toml): the likely failure. The cells now share this budget (`timeout_func`),
# so a cell that really hangs is stopped by nbclient, which names it, before pytest-timeout kills the test unnamed.
NOTEBOOK_BUDGET_S = 1500


def _kernel_in(folder: str):
    """nbclient's kernel manager, with the kernel's sockets as Unix sockets in `folder` (and its connection file
    there) instead of TCP ports on 127.0.0.1: jupyter_client picks free ports, closes them and leaves the kernel
    to bind them once it has started (seconds on a loaded machine), a window in which any other process of a long
    run may take one, and the kernel then dies before it answers. A folder of this test's own has no such race
    and nothing shared with other kernels."""
    from jupyter_client.manager import AsyncKernelManager

    class Kernel(AsyncKernelManager):
        def __init__(self, **kw):
            super().__init__(transport="ipc", ip=str(Path(folder) / "k"),
                             connection_file=str(Path(folder) / "kernel.json"), **kw)
            self.client_factory = _sliced_client()
    return Kernel


POLL_SLICE_S = 5.0  # the longest one wait for a kernel's message lasts before its socket is polled afresh


def _sliced_client():
    """nbclient's kernel client, whose waits for a message (shell and iopub) poll the socket afresh every
    `POLL_SLICE_S` instead of once for a whole cell's timeout. A reply that arrived without waking the one long poll
    (seen here about one run in three of notebook 05, after its widget cell: the kernel idle, its execute_reply never
    read; nbclient issue #312) is then read within seconds instead of hanging the cell until its deadline."""
    import time as _time
    from queue import Empty

    from jupyter_client.asynchronous import AsyncKernelClient
    from jupyter_client.channels import AsyncZMQSocketChannel
    from traitlets import Type

    class Sliced(AsyncZMQSocketChannel):
        async def get_msg(self, timeout=None):
            end = None if timeout is None else _time.monotonic() + timeout
            while True:
                left = None if end is None else max(0.0, end - _time.monotonic())
                try:
                    return await super().get_msg(timeout=POLL_SLICE_S if left is None else min(POLL_SLICE_S, left))
                except Empty:
                    if left is not None and left <= POLL_SLICE_S:
                        raise

    class Client(AsyncKernelClient):
        shell_channel_class = Type(Sliced)
        iopub_channel_class = Type(Sliced)
    return Client


def _cell_name(nb, index: int) -> str:
    """'cell 3 (code cell 2: g = Generation(...))': its index in the notebook and its first source line."""
    cell = nb.cells[index]
    first = next((ln.strip() for ln in cell.source.splitlines() if ln.strip()), "(empty)")
    nth = sum(c.cell_type == "code" for c in nb.cells[: index + 1])
    return f"cell {index} (code cell {nth}: {first[:90]})"


def _why(e: BaseException) -> str:
    """What went wrong, short: a cell's exception and the end of its traceback, a timeout, a dead kernel."""
    import re
    if getattr(e, "ename", None):  # CellExecutionError: the kernel's own exception
        tb = getattr(e, "traceback", None) or ""
        tb = re.sub(r"\x1b\[[0-9;]*m", "", tb if isinstance(tb, str) else "\n".join(tb)).strip().splitlines()
        return f"{e.ename}: {e.evalue}\n" + "\n".join(tb[-12:])
    return f"{type(e).__name__}: {e}"


@pytest.fixture(scope="module")
def zoo_dtype_decided():
    """--dtype auto's decision for the zoo, made once here (measured for real, into the session's cache folder that
    the kernels inherit), so no notebook kernel spends its cells measuring it again."""
    from speclab.models import ModelPaths, resolve_dtype
    return resolve_dtype(ModelPaths())


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_BUDGET_S + 300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_top_to_bottom(path: Path, zoo_dtype_decided):
    """Every cell runs without an error and the figures and tables come out. A failure names the notebook and the
    cell (its index and first line) with the cell's exception, or says that the kernel did not start."""
    import tempfile

    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name} is stored with outputs: clear them before committing"
    t0 = time.monotonic()
    deadline = t0 + NOTEBOOK_BUDGET_S
    at: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="speclab-kernel-") as sockets:  # short: a Unix socket path has 107 bytes
        client = NotebookClient(
            nb, kernel_name="python3", kernel_manager_class=_kernel_in(sockets),
            resources={"metadata": {"path": str(path.parent)}},
            startup_timeout=300,  # not 60: a kernel starts in under a second here, but a loaded machine is slower
            timeout_func=lambda cell: max(1, int(deadline - time.monotonic())),
            iopub_timeout=120, raise_on_iopub_timeout=True,  # a cell's outputs are waited for, never dropped after 4 s
            on_cell_execute=lambda cell, cell_index, **kw: at.update(index=cell_index))
        try:
            client.execute()
        except Exception as e:
            where = _cell_name(nb, at["index"]) if "index" in at else "starting the kernel, before any cell"
            pytest.fail(f"{path.name}, {where}, after {time.monotonic() - t0:.0f} s: {_why(e)}", pytrace=False)
    print(f"{path.name}: executed in {time.monotonic() - t0:.1f} s")
    errors = [f"{_cell_name(nb, i)}: {o.get('ename')}: {o.get('evalue')}" for i, c in enumerate(nb.cells)
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: " + "; ".join(errors)
    shown = [o for c in nb.cells for o in c.get("outputs", [])
             if o.get("output_type") in ("display_data", "execute_result")]
    assert shown, f"{path.name}: no figure or table came out"


@pytest.mark.slow
def test_calibration_widget_slider_redraws_and_save_writes(deep, trained_eagle3, trained_dflash, tmp_path):
    """The widget's callbacks on a real (tiny) bench: moving the slider moves the chosen-threshold marker and
    changes the replayed figure; Save writes the threshold the routers then read."""
    from speclab.bench.calibration import Calibrator
    from speclab.routing.routers import load_calibration
    from speclab.trace import TraceStore
    from speclab.widgets import CalibrationWidget

    models = {"eagle3": trained_eagle3, "dflash": trained_dflash}
    with TraceStore(tmp_path / "w.duckdb") as store:
        cal = Calibrator.prepare(store, deep, models, "zoo", 1, 16, log=lambda s: None)
        w = CalibrationWidget(cal, deep, router="entropy", category="all", path=tmp_path / "cal.json")
        marker = lambda: next(t for t in w.figure.data if t.name == "chosen threshold")  # noqa: E731
        grid_lo, grid_hi = w.slider.min, w.slider.max
        w.slider.value = grid_lo
        low = (marker().x, marker().y, w.message.value)
        w.slider.value = grid_hi
        high = (marker().x, marker().y, w.message.value)
        assert low[0] == (grid_lo,) and high[0] == (grid_hi,) and low[2] != high[2]
        assert low[1] != high[1] or cal.at("entropy", grid_lo, "all")["tau"] == cal.at("entropy", grid_hi, "all")["tau"]
        w.category.value = "code"  # a new category: the slider moves to its optimum
        assert w.slider.value == pytest.approx(cal.best("entropy", "code")["threshold"])
        w.save()
        assert load_calibration(tmp_path / "cal.json").thresholds["entropy"]["code"] == pytest.approx(w.slider.value)
