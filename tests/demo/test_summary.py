"""demo.summary's per-stage lines, on a hand-made report (no model runs)."""
from pocketdiff.demo.summary import TEACHER, TEACHER_TRAILING, stage_lines


def _m(model, steps, fd, clip, mode="embedded"):
    return {"model": model, "steps": steps, "guidance_mode": mode, "fd": fd, "clip_score": clip,
            "features": "FD (shapes-CLIP)", "num_samples": 64}


def _report(**changes):
    report = {
        "reference_steps": 16,
        "students": {"4": "d/round-3", "2": "d/round-4"},
        "student": {"pipeline_dir": "d/round-4", "steps": 2},
        "metrics": [_m(TEACHER, 2, 70.0, 40.0, "cfg"), _m(TEACHER, 4, 9.0, 90.0, "cfg"), _m(TEACHER, 16, 7.0, 95.0, "cfg"),
                    _m(TEACHER_TRAILING, 2, 30.0, 60.0, "cfg"), _m(TEACHER_TRAILING, 4, 10.0, 91.0, "cfg"),
                    _m("student 4", 4, 8.5, 88.0), _m("student 2", 2, 12.0, 85.0),
                    _m("student W8 2", 2, 12.5, 84.0), _m("pruned student 2", 2, 14.0, 80.0)],
        "calibrate": {"bits": 8, "unet_cosine": 0.99996, "float_unet_bytes": 3_200_000, "checkpoint_bytes": 800_000,
                      "parity": {"checks": {"min_unet_cosine": {"threshold": 0.99}}}},
        "prune": {"ratio": 0.3, "params_before": 800_000, "params_after": 640_000, "macs_before": 120_000_000, "macs_after": 100_000_000},
        "bundle": {"bytes": 4_290_000, "components": {
            "text_encoder": {"fully_accelerated": True, "cosine": 0.999999, "bytes": 600_000, "weights": "fp16"},
            "unet": {"fully_accelerated": True, "cosine": 0.99994, "bytes": 1_530_000, "weights": "int8"},
            "vae_decoder": {"fully_accelerated": False, "cosine": 0.99999, "bytes": 1_450_000, "weights": "fp16"}}},
        "run_bundle": {"latency_s": {"total": 0.5, "unet_step_mean": 0.0049}},
    }
    report.update(changes)
    return report


def test_one_line_per_stage_in_chain_order():
    lines = stage_lines(_report())
    assert [line.split()[0] for line in lines] == ["distill", "distill", "quantize", "prune", "export"]
    assert "16 -> 4 steps" in lines[0] and "16 -> 2 steps" in lines[1]


def test_distill_lines_count_guidance_passes_and_compare_the_stronger_teacher_grid():
    four, two = stage_lines(_report())[:2]
    # the teacher's DDIM-16 with classifier-free guidance runs 32 passes per image
    assert "32 -> 4 UNet passes/image (8x fewer)" in four and "32 -> 2 UNet passes/image (16x fewer)" in two
    # at 2 steps the trailing grid is the teacher's better one (FD 30 < 70): it is the baseline shown
    assert "DDIM-2 trailing 30.00/60.0" in two and "70.00" not in two
    assert "DDIM-4 9.00/90.0" in four and "DDIM-16 7.00/95.0" in four
    assert "FD/CLIP 12.00/85.0" in two


def test_compression_lines_state_what_they_buy_and_keep():
    _, _, quant, prune, export = stage_lines(_report())
    assert "3.20 MB -> 0.80 MB (4.00x smaller)" in quant and "0.99996 (bar 0.99)" in quant
    assert "12.50/84.0 vs float 12.00/85.0" in quant
    assert "0.8M -> 0.64M (1.25x fewer)" in prune and "MACs 120M -> 100M" in prune and "14.00/80.0 vs unpruned 12.00/85.0" in prune
    assert "2/3 components fully on the GPU delegate" in export and ">= 0.99994" in export and "UNet step 4.9 ms" in export


def test_missing_rows_say_so_instead_of_failing():
    report = _report(metrics=[m for m in _report()["metrics"] if m["model"] != "student 4"])
    assert "not evaluated" in stage_lines(report)[0]
    report = _report(metrics=[m for m in _report()["metrics"] if m["model"] != "pruned student 2"])
    assert "FD/CLIP n/a vs unpruned" in stage_lines(report)[3]
