"""The adaptive policy's cost profile: measured once (fastest of several rounds, made monotone),
saved, and loaded on the next start without measuring again."""

from __future__ import annotations

import dataclasses
import json

import pytest

import tandem.scheduler.profile as profile_module
from conftest import tiny_loaded
from tandem.scheduler.cost_model import CostCurve
from tandem.model.cost import CONTEXT_FOR_CURVE
from tandem.scheduler.profile import (CONTEXT_REPEATS, CONTEXT_SIZES, LONG_CONTEXT, PROFILE_ROUNDS, PROFILE_SIZES, cost_curve_for,
                                      load_profile, save_profile)


def test_monotone_takes_the_running_minimum_from_the_right():
    def monotone(points):
        return CostCurve.from_points(points).monotone().as_points()

    assert monotone({1: 4.7, 2: 0.34, 4: 0.46}) == {1: 0.34, 2: 0.34, 4: 0.46}
    assert monotone({1: 1.0, 2: 2.0, 8: 3.0}) == {1: 1.0, 2: 2.0, 8: 3.0}


def test_convex_makes_the_cost_of_a_row_non_decreasing_and_keeps_the_ends():
    def convex(points):
        return CostCurve.from_points(points).convex().as_points()

    assert convex({1: 10, 2: 10, 4: 14, 8: 14, 16: 30}) == pytest.approx({1: 10, 2: 10, 4: 34 / 3, 8: 14, 16: 30})
    assert convex({1: 1.0, 2: 2.0, 8: 9.0}) == {1: 1.0, 2: 2.0, 8: 9.0}  # already convex: unchanged
    # The Ice Lake profile whose 12 and 16 rows read alike: every row past 4 now costs 1.27 ms.
    measured = {1: 9.53, 2: 9.91, 3: 10.02, 4: 10.51, 5: 13.39, 6: 13.4, 8: 16.55, 10: 22.61, 12: 25.77, 16: 25.77,
                24: 38.05}
    curve = CostCurve.from_points(measured).convex()
    slopes = [(curve(b) - curve(a)) / (b - a) for a, b in zip(curve.sizes, curve.sizes[1:])]
    assert all(b >= a - 1e-12 for a, b in zip(slopes, slopes[1:]))
    assert curve(16) - curve(12) == pytest.approx(4 * 1.272, rel=0.01)
    assert (curve(1), curve(24)) == (9.53, pytest.approx(38.05))
    assert all(curve(n) <= measured[n] + 1e-9 or n in (2, 24) for n in measured)


def test_measures_once_then_loads(tmp_path, monkeypatch):
    _, loaded = tiny_loaded("llama")

    def fake_prefixes(model, sizes, contexts, repeats):
        # 1 us per key beyond the curve's prefix, plus 0.5 per key and row
        long.append((sizes, contexts, repeats))
        return {c: {n: 0.010 * (1 + n / 8) + (c - CONTEXT_FOR_CURVE) * (1e-6 + 0.5e-6 * n) for n in sizes} for c in contexts}

    def fake_curve(model, repeats, sizes):
        # Round r is slowed by another tenant at size 2 (r = 0) or everywhere (r = 1).
        r = len(calls)
        calls.append(sizes)
        return {n: 0.010 * (1 + n / 8) * (3.0 if r == 1 or (r == 0 and n == 2) else 1.0) for n in sizes}

    calls, long = [], []
    monkeypatch.setattr(profile_module, "forward_cost_curve", fake_curve)
    monkeypatch.setattr(profile_module, "prefix_costs", fake_prefixes)
    monkeypatch.setattr(loaded, "config", dataclasses.replace(loaded.config, max_position_embeddings=4096))
    path = tmp_path / "profile.json"
    curve = cost_curve_for(loaded, "cpu", 1, str(path))
    assert len(calls) == PROFILE_ROUNDS and calls[0] == PROFILE_SIZES
    assert long == [(CONTEXT_SIZES, (CONTEXT_FOR_CURVE, LONG_CONTEXT), CONTEXT_REPEATS)]
    assert curve(2) == pytest.approx(0.010 * 1.25)  # the undisturbed rounds' time
    assert curve.convex() is curve  # already convex: a row never priced below the rows before it
    assert (curve.context, curve.per_key, curve.per_key_row) == (CONTEXT_FOR_CURVE, pytest.approx(1e-6), pytest.approx(0.5e-6))
    saved = json.loads(path.read_text())
    assert saved["model"] == loaded.name and saved["threads"] == 1 and saved["sizes"] == list(PROFILE_SIZES)
    # The next start loads the file and measures nothing.
    again = cost_curve_for(loaded, "cpu", 1, str(path))
    assert again == curve
    assert len(calls) == PROFILE_ROUNDS and len(long) == 1
    cost_curve_for(loaded, "cpu", 1, str(path), remeasure=True)
    assert len(calls) == 2 * PROFILE_ROUNDS


def test_a_model_with_few_positions_prices_every_prefix_alike(tmp_path, monkeypatch):
    _, loaded = tiny_loaded("llama")
    monkeypatch.setattr(profile_module, "forward_cost_curve", lambda model, repeats, sizes: {n: 0.01 * n for n in sizes})

    def never(*args, **kwargs):
        raise AssertionError("no position past the curve's prefix to measure at")

    monkeypatch.setattr(profile_module, "prefix_costs", never)
    monkeypatch.setattr(loaded, "config", dataclasses.replace(loaded.config, max_position_embeddings=CONTEXT_FOR_CURVE + 100))
    curve = cost_curve_for(loaded, "cpu", 1, str(tmp_path / "profile.json"))
    assert curve.per_key == curve.per_key_row == 0.0
    assert curve.context_seconds([5], [2000]) == 0.0


def test_a_broken_profile_says_how_to_recover(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"sizes": [1, 2], "seconds": [0.1]}')
    with pytest.raises(ValueError, match="--reprofile"):
        load_profile(bad)


def test_a_save_replaces_the_profile_whole(tmp_path, monkeypatch):
    """A server starting while another saves reads the old profile or the new one, never half of
    one: the new text is written beside the file and renamed over it."""
    path = tmp_path / "profile.json"
    save_profile(CostCurve((1, 2), (0.1, 0.2)), path, {"model": "old"})
    seen = []
    rename = profile_module.os.replace

    def watching(src, dst):
        seen.append((json.loads(path.read_text())["model"], json.loads(open(src).read())["model"]))
        rename(src, dst)

    monkeypatch.setattr(profile_module.os, "replace", watching)
    save_profile(CostCurve((1, 2), (0.3, 0.4)), path, {"model": "new"})
    assert seen == [("old", "new")]  # until the rename, readers see the whole old profile
    assert load_profile(path).as_points() == {1: 0.3, 2: 0.4}
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temporary file left


def test_the_profile_key_names_the_kernels_and_the_cpu(monkeypatch):
    """A TANDEM_KERNELS override or another CPU never reuses a curve measured on other kernels."""
    from dataclasses import replace

    from tandem.model import kernels
    from tandem.scheduler import profile

    _, loaded = tiny_loaded("llama")
    block = replace(loaded, quantization="native", kernels="block")
    keys = set()
    for variant in kernels.supported_variants()[:2]:
        monkeypatch.setenv("TANDEM_KERNELS", variant)
        keys.add(profile.profile_key(block, "cpu", 2))
    assert len(keys) == len(kernels.supported_variants()[:2])
    monkeypatch.setattr(profile, "cpu_name", lambda: "Another CPU")
    assert profile.profile_key(block, "cpu", 2) not in keys
