"""Hardware cost profiles (`speclab costs measure`, `--costs`, `speclab.routing.hardware`): a profile measured on
the zoo round-trips through its file; the round-cost model is the fit of its tables; replay under two profiles
keeps every tau and moves the best threshold the way the costs say; thresholds calibrated under a profile are
kept under its name and never used by the routers here; the shipped profiles load; bad profiles are one line."""
import json

import numpy as np
import pytest

from helpers import assert_one_error_line
from speclab.bench import routing
from speclab.routing.hardware import FORMAT, cost_model, fit_line, load_profile
from speclab.routing.replay import DRAFTERS, CostModel, Profile
from speclab.routing.routers import Calibration, default_threshold, load_calibration
from speclab.zoo import REPO_ROOT

SHIPPED = sorted((REPO_ROOT / "data" / "costs").glob("*.json"))


def measured(draft=(2.0, 1.0), forward=(4.0, 0.5), catchup=((1.0, 0.1), (0.5, 0.05))) -> dict:
    """Tables that lie exactly on the model's lines."""
    return {"context": 200, "target_forward_ms": {str(n): forward[0] + forward[1] * n for n in (1, 2, 4, 8)},
            "prefill_ms": {str(p): 3.0 + 0.02 * p for p in (16, 64)}, "head_ms": 0.1,
            "drafters": {d: {"draft_ms": draft[i], "width": 4.0, "other_ms": 0.3,
                             "catchup_ms": {str(m): catchup[i][0] + catchup[i][1] * m for m in (1, 4, 16)}}
                         for i, d in enumerate(DRAFTERS)}}


def write_profile(path, m=None, **over) -> str:
    m = m or measured()
    d = {"format": FORMAT, "name": "test", "source": "measured", "machine": {"device": "cpu"}, "dtype": "bf16",
         "models": {}, "measured": m, "cost_model": cost_model(m).to_dict(), **over}
    path.write_text(json.dumps(d))
    return str(path)


def test_the_cost_model_is_the_fit_of_the_measured_tables(tmp_path):
    c = cost_model(measured())
    assert c.verify0 == pytest.approx(4.0) and c.verify1 == pytest.approx(0.5)
    assert c.catchup0 == pytest.approx([1.0, 0.5]) and c.catchup1 == pytest.approx([0.1, 0.05])
    assert c.prefill0 == pytest.approx(3.0) and c.prefill1 == pytest.approx(0.02) and c.draft == [2.0, 1.0]
    assert fit_line([5], [2.0]) == (2.0, 0.0) and fit_line([1, 2], [3.0, 1.0])[1] == 0.0  # no negative slope
    # no negative intercept (a prefill timed once per prompt length can grow faster than a line): through the origin
    assert fit_line([16, 64, 256], [0.5, 1.0, 8.0]) == (0.0, pytest.approx((8 + 64 + 2048) / (256 + 4096 + 65536)))
    p = load_profile(write_profile(tmp_path / "p.json"))
    assert p.cost.to_dict() == c.to_dict() and not p.cost.here and "profile test (measured: cpu, bf16)" in p.cost.label


def synthetic_profiles(n=12, length=60, seed=0) -> list[Profile]:
    """Profiles where EAGLE-3 accepts more where the entropy is high and DFlash where it is low (the paper's
    pattern), so the entropy threshold trades the two."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ent = rng.uniform(0, 4, length)
        acc = np.stack([np.where(ent > 2, 3, 1), np.where(ent > 2, 0, 3)]) + rng.integers(0, 2, (2, length))
        out.append(Profile(f"p{i}", "code" if i % 2 else "math", 8, rng.integers(3, 100, length), length, acc,
                           np.full((2, length), 4), np.zeros((2, length)), ent))
    return out


def test_replay_under_two_profiles_keeps_tau_and_moves_the_threshold():
    profs, grid = synthetic_profiles(), [round(x, 2) for x in np.arange(0, 4.01, 0.25)]
    cheap = CostModel([1.0, 1.0], 5.0, 0.2, [0.5, 0.5], [0.01, 0.01], [0.1, 0.1], 2.0, 0.01, label="cheap")
    dear = CostModel([40.0, 1.0], 5.0, 0.2, [0.5, 0.5], [0.01, 0.01], [0.1, 0.1], 2.0, 0.01, label="dear")
    a, b = routing.sweep(profs, cheap, "entropy", grid), routing.sweep(profs, dear, "entropy", grid)
    assert np.allclose(a.tau, b.tau)  # acceptance is the profiles': only the modeled time differs
    assert (b.tokens_per_s <= a.tokens_per_s + 1e-9).all() and (b.tokens_per_s < a.tokens_per_s).any()
    ta, tb = routing.best_thresholds(a)["*"], routing.best_thresholds(b)["*"]
    assert tb > ta  # EAGLE-3 (chosen above the threshold) dear: the best threshold gives it fewer rounds


def test_thresholds_calibrated_under_a_profile_are_kept_under_its_name(tmp_path, monkeypatch):
    from speclab.bench.calibration import save_thresholds
    from speclab.routing.routers import CALIBRATION_ENV

    out = tmp_path / "cal.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(out))
    save_thresholds("entropy", {"all": 1.5}, "fp", {}, out)
    save_thresholds("entropy", {"all": 3.25, "code": 2.0}, "fp", {}, out, profile="h100-bf16")
    cal = load_calibration(out)
    assert cal.threshold("entropy", None) == 1.5 and cal.for_profile("h100-bf16").threshold("entropy", "code") == 2.0
    assert json.loads(out.read_text())["profiles"]["h100-bf16"]["entropy"] == {"*": 3.25, "code": 2.0}
    assert default_threshold("entropy", "code", "fp") == 1.5  # routers here never read another machine's
    assert Calibration().for_profile("x").thresholds == {}


def test_each_router_s_provenance_survives_the_next_calibration(tmp_path):
    """`speclab calibrate --router entropy,neural` then `--router rule`: every router's sweep stays in `info.grids`
    (the second router's used to replace the first's), and the rule's section beside WhiFlash's."""
    from speclab.bench.calibration import save_thresholds

    out = tmp_path / "cal.json"
    save_thresholds("entropy", {"all": 1.5}, "fp", {"bench": "b1", "grids": {"entropy": "0:8:0.1"}}, out)
    save_thresholds("neural", {"all": 0.5}, "fp", {"bench": "b1", "grids": {"neural": "-3:3:0.05"}}, out)
    save_thresholds("rule", {"all": 3}, "fp", {"rule": {"bench": "b2", "grids": {"rule": "1:16:1"}}}, out)
    info = json.loads(out.read_text())["info"]
    assert info["grids"] == {"entropy": "0:8:0.1", "neural": "-3:3:0.05"} and info["bench"] == "b1"
    assert info["rule"] == {"bench": "b2", "grids": {"rule": "1:16:1"}}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_profiles_load_and_say_where_they_come_from(path):
    p = load_profile(path)
    assert p.source in ("measured", "published") and p.name == path.stem
    if p.source == "published":
        assert p.citation and "published" in p.label
    else:
        assert p.machine["device"] and p.measured["target_forward_ms"] and p.models.get("target")
        fitted = cost_model(p.measured).to_dict()
        assert all(np.allclose(v, fitted[k]) for k, v in p.cost.to_dict().items())


def test_there_are_the_cpu_profiles_and_a_published_one():
    assert {"cpu-fp32", "cpu-bf16"} <= {p.stem for p in SHIPPED}
    assert any(load_profile(p).source == "published" for p in SHIPPED)


@pytest.mark.slow
def test_measure_writes_a_profile_that_loads(tmp_path):
    from helpers import run_cli
    out = tmp_path / "p.json"
    r = run_cli("costs", "measure", "--out", str(out), "--name", "here", "--rows", "1,4", "--backlog", "1,8",
                "--reps", "1", "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    p = load_profile(out)
    assert p.source == "measured" and p.dtype == "float32" and set(p.measured["target_forward_ms"]) == {"1", "4"}
    assert set(p.measured["drafters"]) == set(DRAFTERS) and all(
        d["draft_ms"] > 0 and set(d["catchup_ms"]) == {"1", "8"} for d in p.measured["drafters"].values())
    assert "cost profile here (measured: cpu, float32)" in r.stdout and "Round-cost model" in r.stdout


@pytest.mark.parametrize("case", ["missing", "not-json", "format", "no-citation", "negative", "per-drafter",
                                  "no-name"])
def test_a_bad_profile_is_one_line_before_anything_opens(tmp_path, capsys, case):
    m = measured()
    bad = cost_model(m).to_dict() | {"verify1": -1.0}
    short = cost_model(m).to_dict() | {"draft": [1.0]}
    files = {"missing": (str(tmp_path / "absent.json"), "no such file"),
             "not-json": (str(tmp_path / "x.json"), "not a JSON cost profile"),
             "format": (write_profile(tmp_path / "f.json", format="other/1"), "not a speclab cost profile"),
             "no-citation": (write_profile(tmp_path / "c.json", source="published"), "names its source"),
             "negative": (write_profile(tmp_path / "n.json", cost_model=bad), "cost_model.verify1 must be a number"),
             "per-drafter": (write_profile(tmp_path / "d.json", cost_model=short), "one number per drafter"),
             "no-name": (write_profile(tmp_path / "e.json", name=" "), "has no name")}
    (tmp_path / "x.json").write_text("{not json")
    path, says = files[case]
    db = tmp_path / "none.duckdb"
    for cmd in (["sweep", "--router", "entropy"], ["calibrate"], ["routing"]):
        assert_one_error_line([*cmd, "--costs", path, "--db", str(db)], says, capsys)
    assert not db.exists()


def test_live_runs_are_not_set_beside_another_machines_replay(tmp_path, capsys):
    assert_one_error_line(["sweep", "--router", "entropy", "--live", "1.0", "--costs",
                           write_profile(tmp_path / "p.json"), "--db", str(tmp_path / "t.duckdb")],
                          "--live with --costs", capsys)
