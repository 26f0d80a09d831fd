"""The population report on synthetic populations: the choice uses validation only, the
setting means and intervals, the PBO and the deflated Sharpe ratio against float64 references
written here, the files and figures, and bad input."""

import itertools
import json
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from foxhunt_jax.errors import ConfigError
from foxhunt_jax.research import population as pop
from foxhunt_jax.research.significance import student_t_quantile

BARS_PER_YEAR = 252.0


def _dates(n_bars: int) -> list[str]:
    return [str(d) for d in np.datetime64("2022-03-01") + np.arange(n_bars + 1)]


def _member(rng, index: int, bars: int = 40, windows: int = 12, hparams=None, **fields) -> dict:
    def metrics():
        return {"sharpe": float(rng.normal()), "total_return": float(rng.normal(0, 0.1)),
                "max_drawdown": float(rng.uniform(0, 0.3)), "bars": bars}

    member = {"member": index, "seed": 1000 + index, "hparams": dict(hparams or {}),
              "selected_epoch": int(rng.integers(1, 20)), "validation": metrics(),
              "test": metrics(), "test_percentile": float(rng.uniform(0, 100)),
              "validation_window_returns": rng.normal(0, 0.01, windows).tolist(),
              "test_returns": rng.normal(0, 0.01, bars).tolist(), "test_dates": _dates(bars)}
    member.update(fields)
    return member


def _population(rng, size: int, **kw) -> list[dict]:
    return [_member(rng, i, **kw) for i in range(size)]


# --- the choice ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_member_is_chosen_by_validation_even_when_another_tests_better(seed):
    rng = np.random.default_rng(seed)
    members = _population(rng, 7)
    ids = rng.permutation(np.arange(50, 57))  # ids that are not the list positions
    for m, ident in zip(members, ids):
        m["member"] = int(ident)
    best_val, best_test = rng.choice(7, size=2, replace=False)
    members[best_val]["validation"]["sharpe"] = 5.0
    members[best_test]["test"]["sharpe"] = 9.0
    members[best_val]["test"]["sharpe"] = -3.0
    chosen = pop.chosen_member(members, BARS_PER_YEAR)
    assert chosen["index"] == best_val and chosen["member"] == ids[best_val]
    assert chosen["test"]["sharpe"] == -3.0
    # no look-ahead: any other test period leaves the choice as it is
    for m in members:
        m["test"]["sharpe"] = float(rng.normal(0, 5))
        m["test_returns"] = rng.normal(0, 0.02, 40).tolist()
    assert pop.chosen_member(members, BARS_PER_YEAR)["member"] == ids[best_val]


def test_a_tie_on_validation_goes_to_the_first_in_the_list():
    rng = np.random.default_rng(3)
    members = _population(rng, 5)
    for i in (1, 3, 4):
        members[i]["validation"]["sharpe"] = 2.5
    members[3]["test"]["sharpe"] = 10.0
    assert pop.chosen_member(members, BARS_PER_YEAR)["index"] == 1


# --- tables --------------------------------------------------------------------------------------


def test_student_t_quantile_known_values():
    assert student_t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-4)
    assert student_t_quantile(0.975, 10) == pytest.approx(2.2281, abs=1e-4)


@pytest.mark.parametrize("seed", [4, 5])
def test_setting_summary_matches_a_float64_reference(seed):
    rng = np.random.default_rng(seed)
    grid = [{"train.learning_rate": 1e-3, "train.n_step": 3},
            {"train.learning_rate": 3e-4, "train.n_step": 3},
            {"train.learning_rate": 3e-4, "train.n_step": 5}]
    counts = [int(rng.integers(2, 7)), int(rng.integers(2, 7)), 1]
    order = rng.permutation(np.repeat(np.arange(3), counts))  # settings interleaved
    members = [_member(rng, i, hparams=grid[s]) for i, s in enumerate(order)]
    level = 0.95
    summary = pop.setting_summary(members, level)
    assert [s["hparams"] for s in summary["settings"]] == [grid[s] for s in
                                                           dict.fromkeys(order.tolist())]
    for entry in summary["settings"]:
        indices = [i for i, m in enumerate(members) if m["hparams"] == entry["hparams"]]
        assert entry["members"] == [members[i]["member"] for i in indices]
        assert entry["n"] == len(indices)
        for name, split, key in (("validation_sharpe", "validation", "sharpe"),
                                 ("test_sharpe", "test", "sharpe"),
                                 ("test_total_return", "test", "total_return")):
            values = [members[i][split][key] for i in indices]
            n = len(values)
            mean = math.fsum(values) / n
            assert entry[name]["mean"] == pytest.approx(mean, rel=1e-12, abs=1e-15)
            if n == 1:
                assert entry[name]["low"] is None and entry[name]["high"] is None
                continue
            sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
            half = student_t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
            assert entry[name]["low"] == pytest.approx(mean - half, rel=1e-12, abs=1e-15)
            assert entry[name]["high"] == pytest.approx(mean + half, rel=1e-12, abs=1e-15)
        row = next(line for line in summary["table"].splitlines()
                   if line.startswith(f"| {entry['setting']} "))
        assert f"| {entry['n']} |" in row
    assert "train.learning_rate=0.0003, train.n_step=5" in summary["table"]


def test_member_table_has_a_row_and_the_figures_of_every_member():
    rng = np.random.default_rng(6)
    members = _population(rng, 6, hparams={"train.gamma": 0.99, "env.cost_bps": 2.0})
    lines = pop.member_table(members).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["member", "seed", "train.gamma", "env.cost_bps", "selected epoch",
                      "validation Sharpe", "test Sharpe", "test return", "test max drawdown",
                      "test percentile"]
    assert len(lines) == 2 + len(members)
    for m, line in zip(members, lines[2:]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells == [str(m["member"]), str(m["seed"]), "0.99", "2",
                         str(m["selected_epoch"]), f"{m['validation']['sharpe']:+.2f}",
                         f"{m['test']['sharpe']:+.2f}", f"{m['test']['total_return']:+.2%}",
                         f"{m['test']['max_drawdown']:.2%}", f"{m['test_percentile']:.1f}"]


def test_a_population_of_seeds_only_is_one_setting():
    rng = np.random.default_rng(7)
    summary = pop.setting_summary(_population(rng, 4))
    assert [(s["setting"], s["n"]) for s in summary["settings"]] == [(pop.SEEDS_ONLY, 4)]


def test_settings_are_the_same_whatever_the_order_of_their_keys():
    rng = np.random.default_rng(19)
    members = [_member(rng, 0, hparams={"train.gamma": 0.9, "train.n_step": 3}),
               _member(rng, 1, hparams={"train.n_step": 3, "train.gamma": 0.9})]
    summary = pop.setting_summary(members)
    assert [(s["setting"], s["n"]) for s in summary["settings"]] == [
        ("train.gamma=0.9, train.n_step=3", 2)]
    assert _legend(pop.sharpe_scatter_figure(members))[0] == "train.gamma=0.9, train.n_step=3 (2)"


# --- probability of backtest overfitting ---------------------------------------------------------


def _pbo_reference(matrix: np.ndarray, splits: int) -> float:
    """CSCV by direct loops: blocks of rows, in-sample best by mean, its out-of-sample rank."""
    rows, trials = matrix.shape
    blocks = np.array_split(np.arange(rows), splits)
    below = total = 0
    for chosen in itertools.combinations(range(splits), splits // 2):
        inside = sorted(i for b in chosen for i in blocks[b])
        outside = sorted(set(range(rows)) - set(inside))
        score_in = [sum(matrix[i, j] for i in inside) / len(inside) for j in range(trials)]
        score_out = [sum(matrix[i, j] for i in outside) / len(outside) for j in range(trials)]
        best = max(range(trials), key=lambda j: (score_in[j], -j))
        lower = sum(s < score_out[best] for s in score_out)
        equal = sum(s == score_out[best] for s in score_out)
        w = (lower + (equal + 1) / 2) / (trials + 1)
        below += math.log(w / (1 - w)) <= 0
        total += 1
    return below / total


@pytest.mark.parametrize("windows,splits", [(4, 2), (7, 2), (12, 6), (31, 14), (32, 16),
                                            (80, 16)])
def test_cscv_uses_the_largest_even_split_count_up_to_16(windows, splits):
    assert pop.cscv_splits(windows) == splits


def test_pbo_of_skill_less_members_is_near_one_half_and_matches_the_reference():
    rng = np.random.default_rng(8)
    values = []
    for _ in range(30):
        members = _population(rng, 8, windows=12)
        got = pop.chosen_member(members, BARS_PER_YEAR)["pbo"]
        matrix = np.asarray([m["validation_window_returns"] for m in members]).T
        assert got["splits"] == 6 and got["combinations"] == 20 and got["windows"] == 12
        assert got["pbo"] == pytest.approx(_pbo_reference(matrix, 6), abs=1e-12)
        values.append(got["pbo"])
    assert 0.38 < np.mean(values) < 0.62


def test_pbo_is_zero_for_a_member_best_in_every_window():
    rng = np.random.default_rng(9)
    members = _population(rng, 6, windows=20)
    others = np.asarray([m["validation_window_returns"] for m in members[1:]])
    members[0]["validation_window_returns"] = (others.max(axis=0) + 0.001).tolist()
    got = pop.chosen_member(members, BARS_PER_YEAR)["pbo"]
    assert got["pbo"] == 0.0 and got["splits"] == 10


def test_pbo_is_none_with_a_reason_for_too_few_windows_or_one_member():
    rng = np.random.default_rng(10)
    chosen = pop.chosen_member(_population(rng, 5, windows=3), BARS_PER_YEAR)
    assert chosen["pbo"] is None and "3 validation window" in chosen["pbo_reason"]
    chosen = pop.chosen_member(_population(rng, 1, windows=12), BARS_PER_YEAR)
    assert chosen["pbo"] is None and "one member" in chosen["pbo_reason"]
    assert chosen["deflated_sharpe"] is None and "one member" in chosen["deflated_sharpe_reason"]


# --- deflated Sharpe ratio -----------------------------------------------------------------------


def _dsr_reference(chosen_returns: np.ndarray, all_returns: np.ndarray) -> float:
    normal, g = NormalDist(), 0.5772156649015329
    sharpes = [r.mean() / r.std() for r in all_returns]
    n_trials = len(sharpes)
    variance = np.var(sharpes, ddof=1)
    sr0 = math.sqrt(variance) * ((1 - g) * normal.inv_cdf(1 - 1 / n_trials)
                                 + g * normal.inv_cdf(1 - 1 / (n_trials * math.e)))
    r = chosen_returns
    sr, d = r.mean() / r.std(), r - r.mean()
    skew = np.mean(d ** 3) / np.mean(d ** 2) ** 1.5
    kurt = np.mean(d ** 4) / np.mean(d ** 2) ** 2
    return normal.cdf((sr - sr0) * math.sqrt(r.size - 1)
                      / math.sqrt(1 - skew * sr + (kurt - 1) / 4 * sr ** 2))


@pytest.mark.parametrize("seed", [11, 12])
def test_deflated_sharpe_counts_every_member_on_the_test_period(seed):
    rng = np.random.default_rng(seed)
    members = _population(rng, 8, bars=250)
    members[5]["validation"]["sharpe"] = 4.0
    members[5]["test_returns"] = rng.normal(0.001, 0.01, 250).tolist()
    returns = np.asarray([m["test_returns"] for m in members])
    d = pop.chosen_member(members, BARS_PER_YEAR)["deflated_sharpe"]
    assert d["n_trials"] == 8 and d["period"] == "test" and d["observations"] == 250
    assert d["probability"] == pytest.approx(_dsr_reference(returns[5], returns), rel=1e-9)
    assert 0.01 < d["probability"] < 0.99
    assert d["sharpe_annualized"] == pytest.approx(
        returns[5].mean() / returns[5].std() * math.sqrt(BARS_PER_YEAR), rel=1e-12)
    # the same members tried twice: N doubles, the bar to beat rises, the DSR falls
    twice = members + [dict(m, member=m["member"] + 100) for m in members]
    d2 = pop.chosen_member(twice, BARS_PER_YEAR)["deflated_sharpe"]
    assert d2["n_trials"] == 16
    assert d2["expected_max_sharpe_per_bar"] > d["expected_max_sharpe_per_bar"]
    assert d2["probability"] < d["probability"]
    assert d2["probability"] == pytest.approx(
        _dsr_reference(returns[5], np.concatenate([returns, returns])), rel=1e-9)


def test_deflated_sharpe_is_none_with_a_reason_for_a_flat_chosen_member():
    rng = np.random.default_rng(13)
    members = _population(rng, 4)
    members[2]["validation"]["sharpe"] = 3.0
    members[2]["test_returns"] = [0.0] * 40  # never held a position
    chosen = pop.chosen_member(members, BARS_PER_YEAR)
    assert chosen["deflated_sharpe"] is None and "constant" in chosen["deflated_sharpe_reason"]


# --- the report folder and its figures -----------------------------------------------------------


def _legend(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_report_writes_its_files_and_the_figures_name_what_the_tables_name(tmp_path):
    rng = np.random.default_rng(14)
    grid = [{"train.learning_rate": 1e-3}, {"train.learning_rate": 3e-4}]
    members = [_member(rng, i, hparams=grid[i % 2]) for i in range(6)]
    out = tmp_path / "runs" / "population"
    report = pop.population_report(members, out, BARS_PER_YEAR)
    assert sorted(p.name for p in out.iterdir()) == sorted(pop.REPORT_FILES)
    assert report["written"] == [str(out / name) for name in pop.REPORT_FILES]
    for name in (pop.SCATTER_PNG, pop.BAND_PNG):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((out / pop.REPORT_JSON).read_text())
    chosen = pop.chosen_member(members, BARS_PER_YEAR)
    assert saved["chosen"]["member"] == chosen["member"] == report["chosen"]["member"]
    assert [r["member"] for r in saved["members"]] == [m["member"] for m in members]
    assert saved["chosen"]["pbo"]["pbo"] == chosen["pbo"]["pbo"]
    assert saved["test_period"] == {"start": members[0]["test_dates"][0],
                                    "end": members[0]["test_dates"][-1], "bars": 40}
    markdown = (out / pop.REPORT_MD).read_text()
    summary = pop.setting_summary(members)
    assert pop.member_table(members) in markdown and summary["table"] in markdown
    for line in pop.chosen_lines(chosen, len(members)):
        assert f"- {line}" in markdown

    scatter = pop.sharpe_scatter_figure(members)
    assert _legend(scatter) == ([f"{s['setting']} ({s['n']})" for s in summary["settings"]]
                                + [pop.chosen_label(chosen["member"]), "test = validation"])
    assert chosen["label"] == pop.chosen_label(chosen["member"])
    assert scatter.axes[0].get_xlabel().startswith("validation Sharpe")
    assert scatter.axes[0].get_ylabel().startswith("test Sharpe")
    band = pop.equity_band_figure(members)
    assert _legend(band) == [f"each member ({len(members)})", saved["band"],
                             "members, median", chosen["label"]]
    assert band.axes[0].get_xlabel() == "date"


def test_equity_curves_start_at_one_and_compound_the_returns():
    rng = np.random.default_rng(15)
    members = _population(rng, 3)
    dates, curves = pop.equity_curves(members)
    assert dates[0] == np.datetime64(members[0]["test_dates"][0])
    for m, curve in zip(members, curves):
        expected = [1.0]
        for r in m["test_returns"]:
            expected.append(expected[-1] * math.exp(r))
        np.testing.assert_allclose(curve, expected, rtol=1e-12)


def test_a_rerun_replaces_its_own_files_but_never_a_user_file(tmp_path):
    rng = np.random.default_rng(16)
    members = _population(rng, 3)
    out = tmp_path / "rep"
    pop.population_report(members, out, BARS_PER_YEAR)
    first = (out / pop.REPORT_JSON).read_text()
    members[0]["validation"]["sharpe"] = 7.0
    pop.population_report(members, out, BARS_PER_YEAR)  # its own files: replaced
    assert (out / pop.REPORT_JSON).read_text() != first
    assert sorted(p.name for p in out.iterdir()) == sorted(pop.REPORT_FILES)

    user = tmp_path / "user"
    user.mkdir()
    (user / pop.REPORT_MD).write_text("my notes\n")
    with pytest.raises(ConfigError, match="was not written by a population report"):
        pop.population_report(members, user, BARS_PER_YEAR)
    assert [p.name for p in user.iterdir()] == [pop.REPORT_MD]
    assert (user / pop.REPORT_MD).read_text() == "my notes\n"
    (user / pop.REPORT_MD).unlink()
    (user / pop.REPORT_JSON).write_text(json.dumps({"files": list(pop.REPORT_FILES)}))
    with pytest.raises(ConfigError, match="population_report.json exists"):
        pop.population_report(members, user, BARS_PER_YEAR)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        pop.population_report(members, a_file, BARS_PER_YEAR)


# --- bad input -----------------------------------------------------------------------------------


def _set(index, key, value):
    def change(members):
        members[index][key] = value
    return change


def _drop(index, key):
    def change(members):
        del members[index][key]
    return change


def _set_metric(index, split, key, value):
    def change(members):
        members[index][split][key] = value
    return change


BAD = [
    (_drop(2, "test_returns"), r"member 2 \(entry 2\): missing key 'test_returns'"),
    (_drop(1, "hparams"), r"member 1 \(entry 1\): missing key 'hparams'"),
    (_set_metric(3, "validation", "sharpe", float("nan")),
     r"member 3 \(entry 3\): 'validation'\['sharpe'\] must be a finite number"),
    (_set_metric(0, "test", "max_drawdown", float("inf")), r"'test'\['max_drawdown'\]"),
    (lambda ms: ms[1]["test"].pop("total_return"), r"member 1 .*'test' has no 'total_return'"),
    (lambda ms: ms[2]["test_returns"].__setitem__(5, float("nan")),
     r"member 2 .*'test_returns' holds non-finite values \(first at position 5\)"),
    (lambda ms: ms[3]["validation_window_returns"].append(0.0),
     r"member 3 .*'validation_window_returns' has 13 windows, the first member 12"),
    (lambda ms: ms[1]["test_dates"].pop(), r"member 1 .*'test_dates' has 40 dates for 40"),
    (lambda ms: ms[2].update(test_returns=ms[2]["test_returns"][:-1],
                             test_dates=ms[2]["test_dates"][:-1]),
     r"member 2 .*'test_dates' differ from the first member's"),
    (_set(1, "test_dates", ["2022-01-01"] * 41), r"member 1 .*strictly increasing"),
    (_set(1, "test_dates", ["not a date"] * 41), r"member 1 .*not ISO 8601"),
    (_set(3, "member", 0), r"member 0 \(entry 3\): member id 0 appears twice"),
    (_set(2, "seed", 1.5), r"member 2 .*'seed' must be an integer"),
    (_set(2, "member", True), r"entry 2\): 'member' must be an integer"),
    (_set(1, "hparams", {"train.gamma": 0.9}), r"member 1 .*every member must set the same"),
    (_set(0, "test_percentile", 101.0), r"member 0 .*'test_percentile' must be a number in"),
    (_set(1, "validation", "fast"), r"member 1 .*'validation' must be a metrics dict"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_members_raise_one_line_naming_the_member_and_key(tmp_path, change, message):
    rng = np.random.default_rng(17)
    members = _population(rng, 4)
    change(members)
    for call in (pop.member_table, pop.setting_summary,
                 lambda ms: pop.chosen_member(ms, BARS_PER_YEAR)):
        with pytest.raises(ValueError, match=message) as err:
            call(members)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=message):
        pop.population_report(members, tmp_path / "out", BARS_PER_YEAR)
    assert not (tmp_path / "out").exists()  # nothing written


def test_empty_or_malformed_populations_and_bad_numbers_raise():
    rng = np.random.default_rng(18)
    with pytest.raises(ValueError, match="members is empty"):
        pop.member_table([])
    with pytest.raises(ValueError, match="must be a list of dicts"):
        pop.member_table({"member": 0})
    with pytest.raises(ValueError, match="entry 1: must be a dict"):
        pop.member_table([_member(rng, 0), 3])
    members = _population(rng, 3)
    with pytest.raises(ValueError, match="bars_per_year must be a finite number > 0"):
        pop.chosen_member(members, 0.0)
    with pytest.raises(ValueError, match="level must be in"):
        pop.setting_summary(members, level=1.5)
    members[1]["hparams"] = {"train.gamma": float("nan")}
    members[0]["hparams"] = members[2]["hparams"] = {"train.gamma": 0.9}
    with pytest.raises(ValueError, match=r"member 1 .*hparams\['train.gamma'\] is not finite"):
        pop.member_table(members)


def test_the_example_of_docs_research_population_report_runs(tmp_path, monkeypatch):
    text = (Path(__file__).resolve().parents[2] / "docs" / "research.md").read_text()
    section = text.split("## Population report\n", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope = {"members": _population(np.random.default_rng(20), 4)}
    exec(compile(block, "docs/research.md", "exec"), scope)
    assert scope["report"]["chosen"]["member"] in range(4)
    assert sorted(p.name for p in (tmp_path / "runs/pop/population").iterdir()) == sorted(
        pop.REPORT_FILES)
