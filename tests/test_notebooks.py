"""Every notebook in notebooks/ executes top to bottom on the zoo (nbclient, a real kernel), stored without
outputs; and the calibration widget's controls change what it shows."""
import time
from pathlib import Path

import nbformat
import pytest

from speclab.zoo import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_five_walkthroughs():
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_top_to_bottom(path: Path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code"), \
        f"{path.name} is stored with outputs: clear them before committing"
    t0 = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s")
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    shown = [o for c in nb.cells for o in c.get("outputs", [])
             if o.get("output_type") in ("display_data", "execute_result")]
    assert shown  # figures and tables really came out


@pytest.mark.slow
def test_calibration_widget_slider_redraws_and_save_writes(deep, trained_eagle3, trained_dflash, tmp_path):
    """The widget's callbacks on a real (tiny) bench: moving the slider moves the chosen-threshold marker and
    changes the replayed figure; Save writes the threshold the routers then read."""
    from speclab.routing.calibration import Calibrator
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
