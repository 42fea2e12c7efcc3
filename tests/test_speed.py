"""Plans that know speed: a calibrated cost per weight type, predictions, and the policy."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from localchat.cli.main import main
from localchat.errors import UsageError
from localchat.gguf.info import read_gguf
from localchat.models import calibrate, timing_models
from localchat.models.calibrate import solve_costs
from localchat.models.catalog import find_model, load_catalog
from localchat.models.demo import make_demo_model, write_staged
from localchat.models.hardware import GPU_NVIDIA, Hardware
from localchat.models.planner import plan_catalog, plan_file, plan_model, sized_candidates
from localchat.models.speed import (
    ROW_COST_WEIGHTS,
    STEP_SIZES,
    SpeedModel,
    load_speed_model,
    machine_name,
    token_work,
)
from localchat.models.timing_models import CALIBRATION_MIN_BYTES, calibration_min_bytes
from localchat.paths import app_paths

GIB = 1024**3
LAPTOP = Hardware(24 * GIB, 23 * GIB, 2)
NS = 1e-9


def _speed(**gen_ns_per_byte: float) -> SpeedModel:
    """A calibration with the given costs (ns per byte); prefill ten times cheaper."""
    gen = {t: ns * NS for t, ns in gen_ns_per_byte.items()}
    return SpeedModel(gen, 1e-4, {t: c / 10 for t, c in gen.items()}, 1e-5, machine_name(), 2)


# Costs of the kind measured on two cores: F16 streams, K-quants pay for dequantization.
TWO_CORES = _speed(F16=0.037, Q8_0=0.05, Q6_K=0.07, Q5_K=0.07, Q4_K=0.052, Q2_K=0.074)


def test_costs_are_solved_one_type_at_a_time() -> None:
    true = {"F16": 2.0, "Q8_0": 3.0, "Q6_K": 5.0, "Q4_K": 4.0, "Q2_K": 7.0, "Q3_K": 7.0}
    overhead = 10.0
    files = [
        {"F16": 100},
        {"Q8_0": 60, "F32": 1},  # a norm's bytes are too few to solve from
        {"Q6_K": 40},
        {"Q4_K": 30, "Q6_K": 10},
        {"Q3_K": 15, "Q6_K": 3},
        {"Q2_K": 20, "Q3_K": 15},
    ]
    timed = [(f, overhead + sum(n * true.get(t, 0.0) for t, n in f.items())) for f in files]
    solved = solve_costs(list(reversed(timed)), overhead)  # any order: each waits its turn
    for weight_type, cost in true.items():
        assert solved[weight_type] == pytest.approx(cost, rel=0.05), weight_type
    with pytest.raises(ValueError, match="one weight type at a time"):
        solve_costs([({"Q4_K": 30, "Q6_K": 10}, 100.0)], overhead)


def test_a_real_calibration_predicts_every_catalog_plan(
    speed_calibration: SpeedModel,
) -> None:
    assert speed_calibration.gen_s_per_byte["F16"] > 0
    assert speed_calibration.gen_s_per_byte["Q8_0"] > 0
    assert set(speed_calibration.measured) == {"F16", "Q8_0"}
    plans = plan_catalog(load_catalog(), LAPTOP, 8192, speed_calibration)
    assert all(p.predicted_gen_tps and p.predicted_gen_tps > 0 for p in plans if p.fits)
    assert all(p.predicted_prompt_tps and p.predicted_prompt_tps > 0 for p in plans if p.fits)
    assert all("tok/s here" in p.explanation for p in plans if p.fits)
    # Bigger models of one family read more bytes per token: they are predicted slower.
    qwen = {p.model: p.predicted_gen_tps or 0.0 for p in plans if p.model.startswith("qwen")}
    assert qwen["qwen2.5-0.5b-instruct"] > qwen["qwen2.5-3b-instruct"] > 0
    # The steps that verify drafts were timed per type (less the tiny model's fixed part):
    # every plan on the CPU has a curve that starts at one step and never falls.
    assert len(speed_calibration.step_overhead_s) == len(STEP_SIZES)
    assert set(speed_calibration.step_s_per_byte) == {"F16", "Q8_0"}
    for plan in plans:
        curve = plan.predicted_step_costs
        assert curve is not None and list(curve) == list(STEP_SIZES) and curve[1] == 1.0
        costs = list(curve.values())
        assert costs == sorted(costs)


def test_a_models_step_curve_is_its_weight_types_and_fixed_part() -> None:
    # Per byte, by step size (1, 2, 3, 5, 9 tokens): a memory-bound type costs the same
    # for 3 tokens as for one, then rises; a compute-bound one rises from the start.
    flat = [1e-9, 1e-9, 1e-9, 2e-9, 4e-9]
    steep = [1e-9, 1.5e-9, 2e-9, 3e-9, 5e-9]
    fixed = [1e-3, 1.2e-3, 1.4e-3, 1.8e-3, 2.6e-3]
    speed = replace(TWO_CORES, step_s_per_byte={"Q4_0": flat, "Q4_K": steep}, step_overhead_s=fixed)
    big_flat = speed.step_costs({"Q4_0": 10**8})  # 0.1 s a step: the fixed part is nothing
    assert big_flat is not None
    assert big_flat[3] == pytest.approx(1.0, abs=0.01) and big_flat[9] == pytest.approx(4.0, 0.01)
    mixed = speed.step_costs({"Q4_0": 10**8, "Q4_K": 10**8})
    assert mixed is not None and mixed[3] == pytest.approx(1.5, 0.01)
    # A model small enough that the fixed part matters follows the fixed part's curve more.
    small = speed.step_costs({"Q4_K": 10**6})  # 1 ms of weights, 1 ms fixed
    assert small is not None and small[2] == pytest.approx((1.2e-3 + 1.5e-3) / 2e-3, 0.01)
    # A type not measured is priced like a similar one (Q4_1 like Q4_0), else the slowest
    # at the largest step; a faster batch kernel never makes a step cheaper than a smaller one.
    assert speed.step_costs({"Q4_1": 10**8}) == big_flat
    assert speed.step_costs({"Q3_K": 10**8}) == speed.step_costs({"Q4_K": 10**8})
    dip = replace(speed, step_s_per_byte={"Q5_0": [1e-9, 0.8e-9, 0.9e-9, 1.5e-9, 2e-9]})
    curve = dip.step_costs({"Q5_0": 10**8})
    assert curve is not None and curve[2] == curve[3] == 1.0
    # Without those figures (a calibration saved before them) there is no curve.
    assert TWO_CORES.step_costs({"Q4_0": 10**8}) is None


def test_calibration_files_read_past_a_processor_cache_and_price_prompts(
    speed_calibration: SpeedModel, models_dir: Path
) -> None:
    # The fixture's calibration read such files and left none behind: each type's reads at
    # least 100 MB a token (smaller ones ran from a 480 MiB cache and timed fast by luck),
    # and more on a machine of a bigger cache, in at least two layers.
    assert not list((models_dir / "calibration").glob("*speed*"))
    with timing_models.SpeedScratch(models_dir / "calibration") as scratch:
        for weight_type in ("F16", "Q8_0"):
            info = scratch.info(weight_type)
            assert read_gguf(scratch.path).tensors == info.tensors  # the type it now holds
            assert sum(t.n_bytes for t in info.tensors) >= calibration_min_bytes()
            assert info.n_layer >= 2
            # A prompt token skips the output matrix and the last layer's feed-forward.
            skipped = [
                t for t in info.tensors
                if t.ggml_type == weight_type
                and (t.name == "output.weight" or t.name.startswith(f"blk.{info.n_layer - 1}.ffn_"))
            ]  # fmt: skip
            gen = token_work(info)[weight_type]
            prompt = token_work(info, prompt=True)[weight_type]
            weighted = sum(
                t.n_bytes * (t.shape[0] + ROW_COST_WEIGHTS) / t.shape[0] for t in skipped
            )
            assert gen - prompt == pytest.approx(weighted, rel=1e-6)


def test_each_calibration_file_is_written_over_the_last_one(tmp_path: Path) -> None:
    """One scratch file, rewritten in place for each type (its pages reused: fresh memory
    costs a fault per page in a virtual machine), cut to the length of what it holds, and
    gone when the calibration ends."""
    with timing_models.SpeedScratch(tmp_path) as scratch:
        path = scratch.holding("Q2_K")
        path = scratch.holding("F16")  # grown over a smaller one: as if written afresh
        fresh = tmp_path / "fresh.gguf"
        write_staged(fresh, timing_models.calibration_shape("F16"), 0, weight_types="F16")
        assert path.read_bytes() == fresh.read_bytes()
        inode, f16_size = path.stat().st_ino, path.stat().st_size
        assert scratch.holding("Q4_0") == path and path.stat().st_ino == inode
        q4_0 = read_gguf(path)
        assert {t.ggml_type for t in q4_0.tensors if len(t.shape) > 1} == {"Q4_0"}
        end = q4_0.data_offset + max(t.offset + t.n_bytes for t in q4_0.tensors)
        assert end <= path.stat().st_size < f16_size  # no F16 bytes left past its end
        assert path.stat().st_mode & 0o077 == 0
        assert scratch.info("F16").tensors[0].ggml_type == "F16"  # known without a write
        assert read_gguf(path).tensors == q4_0.tensors
    assert not path.exists()
    with pytest.raises(UsageError, match="no speed model of 'IQ2_XS'"):
        timing_models.SpeedScratch(tmp_path).holding("IQ2_XS")


def test_calibration_files_outgrow_a_big_processor_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A 32 MiB cache: files of 100 MB and readings of 64 + 25 tokens, as always.
    monkeypatch.setattr(timing_models, "last_level_cache_bytes", lambda: 32 << 20)
    assert calibration_min_bytes() == CALIBRATION_MIN_BYTES
    small_layers = timing_models.calibration_shape("Q4_0").n_layer
    assert calibrate.reading_tokens() == (calibrate.PROMPT_TOKENS, calibrate.GEN_TOKENS)
    # A shared 480 MiB one (a cloud Xeon): files of 40% of it, read in fewer, longer steps.
    monkeypatch.setattr(timing_models, "last_level_cache_bytes", lambda: 480 << 20)
    assert calibration_min_bytes() == int(0.4 * (480 << 20))
    assert timing_models.calibration_shape("Q4_0").n_layer >= 2 * small_layers
    prompt, gen = calibrate.reading_tokens()
    assert calibrate.MIN_PROMPT_TOKENS <= prompt < calibrate.PROMPT_TOKENS
    assert calibrate.MIN_GEN_TOKENS <= gen < calibrate.GEN_TOKENS
    # The tiny model's reading (milliseconds) always takes the full count.
    assert calibrate.reading_tokens(calibrate.OVERHEAD) == (
        calibrate.PROMPT_TOKENS,
        calibrate.GEN_TOKENS,
    )
    # A reported cache of gigabytes (a hypervisor's whole host) does not make such files.
    monkeypatch.setattr(timing_models, "last_level_cache_bytes", lambda: 8 << 30)
    assert calibration_min_bytes() == timing_models.CALIBRATION_MAX_BYTES


def test_speed_models_left_behind_are_deleted(tmp_path: Path) -> None:
    # Those earlier versions kept (nine, 100 MB or more each) and the scratch files of
    # calibrations killed midway (no lock held) go; a running calibration's scratch (locked)
    # and other models stay.
    killed = tmp_path / f"{timing_models.SCRATCH_PREFIX}0123456789ab.gguf"
    left = [tmp_path / "speed-1536x8960x24-Q4_0.gguf", tmp_path / "speed-1536x8960-F16.gguf"]
    kept = [tmp_path / "mix-0.5b-1024x4096-Q4_0-s0.gguf", tmp_path / "demo-tiny-F16-s0.gguf"]
    for path in [*left, killed, *kept]:
        path.write_bytes(b"GGUF")
    with timing_models.SpeedScratch(tmp_path) as running:
        running.holding("Q2_K")
        timing_models.remove_left_speed_models(tmp_path)
        assert running.path.exists() and read_gguf(running.path).tensors
    assert [p.exists() for p in [*left, killed, *kept]] == [False, False, False, True, True]


def test_a_saved_calibration_still_clears_what_earlier_versions_kept() -> None:
    paths = app_paths()
    _speed(Q4_K=1.0).save(paths.speed_calibration)
    paths.demo_models_dir.mkdir(parents=True, exist_ok=True)
    kept_by_an_older_version = paths.demo_models_dir / "speed-1536x8960x24-Q8_0.gguf"
    kept_by_an_older_version.write_bytes(b"GGUF")
    assert calibrate.speed_model(paths).gen_s_per_byte == {"Q4_K": 1.0 * NS}
    assert not kept_by_an_older_version.exists()


def test_a_prompt_token_costs_what_it_adds_to_a_batch() -> None:
    # A batch of 21 tokens in 0.21 s past a big cache, of which one weight read (a single
    # step, 0.04 s): each token adds 8.5 ms, where the batch's mean is 10 ms.
    assert calibrate.prompt_token_s(0.21, 21, 0.04) == pytest.approx(0.0085)
    # A step timed slower than the batch (noise) never makes a token free.
    assert calibrate.prompt_token_s(0.05, 21, 0.2) == pytest.approx(0.025 / 20)


def test_a_byte_of_a_short_row_costs_more_than_one_of_a_long_row(tmp_path: Path) -> None:
    # The same weights as 896-wide rows (Qwen2.5-0.5B) and as rows of 4096 (a 7B): each row's
    # fixed cost is spread over fewer bytes in the first.
    info = read_gguf(make_demo_model(tmp_path / "m.gguf", "tiny", "F16"))
    work = token_work(info)["F16"]
    matrices = [t for t in info.tensors if len(t.shape) > 1 and t.ggml_type == "F16"]
    streamed = sum(t.n_bytes for t in matrices)
    assert work > streamed  # tiny's 128-wide rows: far more than their bytes
    assert (896 + ROW_COST_WEIGHTS) / 896 > (4096 + ROW_COST_WEIGHTS) / 4096 > 1


def test_no_catalog_model_is_planned_at_f16_on_a_big_cpu_machine() -> None:
    for speed in (None, TWO_CORES):
        for plan in plan_catalog(load_catalog(), LAPTOP, 8192, speed):
            assert plan.fits and plan.quant not in ("F16", "BF16"), plan.explanation


def test_the_best_quant_that_is_fast_enough_and_why_not_the_next_better() -> None:
    entry = find_model(load_catalog(), "qwen2.5-3b-instruct")
    candidates = sized_candidates(entry.dims, [(f.quant, f.file, f.size) for f in entry.files])
    fast = plan_model(entry.name, entry.dims, candidates, LAPTOP, 8192, TWO_CORES, min_tps=1.0)
    assert fast.quant == "Q8_0"  # everything is fast enough: the best quality, never F16
    wanted = 7.5
    plan = plan_model(entry.name, entry.dims, candidates, LAPTOP, 8192, TWO_CORES, wanted)
    assert plan.predicted_gen_tps is not None and plan.predicted_gen_tps >= wanted
    assert plan.quant != "Q8_0"
    better = [f.quant for f in entry.files]
    next_better = better[better.index(plan.quant) - 1]
    assert f"; {next_better} would be ~" in plan.explanation, plan.explanation
    # Nothing meets it: the fastest of the quants that keep quality, saying so.
    slow = plan_model(entry.name, entry.dims, candidates, LAPTOP, 8192, TWO_CORES, 500.0)
    assert slow.quant in ("Q4_K_M", "Q5_K_M") and slow.fits
    assert "under the 500 tok/s wanted: the fastest that fits" in slow.explanation
    assert slow.quant != "Q2_K", "speed never buys a quant below Q4_K_M"


def test_f16_is_planned_when_it_is_all_there_is(tmp_path: Path) -> None:
    path = make_demo_model(tmp_path / "only-F16.gguf", "tiny", "F16")
    plan = plan_file(path, LAPTOP, 2048, TWO_CORES)
    assert plan.fits and plan.quant == "F16" and plan.predicted_gen_tps


def test_gpu_layers_are_predicted_from_the_gpus_bandwidth() -> None:
    entry = find_model(load_catalog(), "qwen2.5-7b-instruct")
    candidates = sized_candidates(entry.dims, [(f.quant, f.file, f.size) for f in entry.files])
    gpu = Hardware(16 * GIB, 16 * GIB, 8, 12 * GIB, 12 * GIB, GPU_NVIDIA, "RTX", True)
    unknown = plan_model(entry.name, entry.dims, candidates, gpu, 4096, TWO_CORES)
    assert unknown.n_gpu_layers > 0 and unknown.predicted_gen_tps is None
    known = Hardware(16 * GIB, 16 * GIB, 8, 12 * GIB, 12 * GIB, GPU_NVIDIA, "RTX", True, 360e9)
    plan = plan_model(entry.name, entry.dims, candidates, known, 4096, TWO_CORES)
    cpu = plan_model(entry.name, entry.dims, candidates, LAPTOP, 4096, TWO_CORES, 1.0)
    assert plan.predicted_gen_tps and cpu.predicted_gen_tps
    assert plan.predicted_gen_tps > 5 * cpu.predicted_gen_tps


def test_a_calibration_from_another_machine_or_damaged_is_measured_again(
    calibrated: SpeedModel,
) -> None:
    path = app_paths().speed_calibration
    assert load_speed_model(path) == calibrated
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "machine": "someone else's laptop"}))
    assert load_speed_model(path) is None
    path.write_text("{not json")
    assert load_speed_model(path) is None
    assert path.stat().st_mode & 0o777 == 0o600


def test_hw_measures_once_keeps_it_and_calibrate_measures_again(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("localchat.models.calibrate.CALIBRATION_TYPES", ("F16",))
    # The caching is tested here, not the acceptance of readings (test_calibration.py).
    monkeypatch.setattr("localchat.models.calibrate.MIN_CPU_SHARE", 0.0)
    monkeypatch.setattr("localchat.models.calibrate.MAX_OTHERS_SHARE", 1.0)
    monkeypatch.setattr("localchat.models.calibrate.AGREE", 100.0)
    assert main(["hw", "--json"]) == 0
    first = capsys.readouterr()
    assert "measuring this machine's speed" in first.err
    plans = json.loads(first.out)["plans"]
    assert all(p["predicted_gen_tps"] > 0 for p in plans if p["fits"])
    saved = app_paths().speed_calibration.read_text()
    assert main(["hw"]) == 0
    again = capsys.readouterr()
    assert "measuring" not in again.err and "tok/s here" in again.out
    assert app_paths().speed_calibration.read_text() == saved
    assert main(["hw", "--calibrate", "--json"]) == 0
    assert "measuring this machine's speed" in capsys.readouterr().err


def test_models_lists_predicted_speeds_and_marks_the_pick(
    calibrated: SpeedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["models", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r["source"] == "catalog"]
    for name in {r["model"] for r in rows}:
        mine = [r for r in rows if r["model"] == name]
        assert sum(r["planned"] for r in mine) == 1, name
        assert all(r["predicted_gen_tps"] for r in mine if r["fit"] != "too big"), name
    assert main(["models"]) == 0
    table = capsys.readouterr().out
    assert "t/s" in table and "* the planner's pick" in table


def test_the_speed_setting_is_read_and_checked(capsys: pytest.CaptureFixture[str]) -> None:
    # Fixed costs (a measured calibration varies with the machine's load): the policy is what
    # is tested here, not the measurement.
    TWO_CORES.save(app_paths().speed_calibration)
    settings = app_paths().settings_file
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text("min_tokens_per_s = 0.5\n")
    assert main(["hw", "--json", "--ram", "20GiB"]) == 0  # a given machine: every Q8_0 fits
    plans = json.loads(capsys.readouterr().out)["plans"]
    # Everything is fast enough at half a token a second: the best quality each time, Q8_0
    # (16 bits are not worth their size), or the best an entry publishes below it.
    best = {m.name: next(q for q in m.quants if q != "F16") for m in load_catalog()}
    assert all(p["quant"] == best[p["model"]] for p in plans if p["fits"])
    assert sum(p["quant"] == "Q8_0" for p in plans if p["fits"]) > len(plans) // 2
    settings.write_text('min_tokens_per_s = "fast"\n')
    assert main(["hw"]) == 2
    assert "min_tokens_per_s must be a non-negative number" in capsys.readouterr().err


def test_a_noisy_round_never_makes_a_weight_type_free() -> None:
    # The fixed cost measured high (a busy moment): the files alone still price each type.
    solved = solve_costs([({"F16": 100}, 5.0), ({"Q8_0": 50}, 2.0)], overhead_s=8.0)
    assert solved["F16"] == pytest.approx(0.05) and solved["Q8_0"] == pytest.approx(0.04)


def test_attention_is_every_query_heads_work_over_the_fill_and_a_window_at_most() -> None:
    from localchat.gguf.estimate import ModelDims
    from localchat.models.speed import attention_work

    qwen = ModelDims(24, 896, 14, 2, 64, 64, 151_936, 32_768)  # Qwen2.5-0.5B: 14 heads on 2
    assert attention_work(qwen, 512) == 24 * 14 * (64 + 64) * 2 * 512
    assert attention_work(qwen, 0) == 0
    gemma = ModelDims(18, 640, 4, 1, 256, 256, 262_144, 32_768, 512, 6)  # 15 of 18 windowed
    per_position = 4 * 512 * 2
    assert attention_work(gemma, 4096) == (3 * 4096 + 15 * 512) * per_position
    speed = SpeedModel({"F16": 1e-11}, 0.0, {"F16": 1e-11}, 0.0, "m", 2, attention_s_per_byte=4e-11)
    slow = speed.predict({"F16": 10**8}, attention_work(qwen, 4096))
    fast = speed.predict({"F16": 10**8}, attention_work(qwen, 64))
    assert slow is not None and fast is not None and slow.gen_tps < fast.gen_tps
