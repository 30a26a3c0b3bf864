"""`get_profile("file:<path>")`: a calibrated profile JSON file as the sim's step-time model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.kv.step_profile import ProfileFileError, StepTimeProfile, get_profile

CALIBRATED = {
    "name": "calibrated-tiny",
    "a": 0.002,
    "b": 1.5e-5,
    "c": 1e-4,
    "d": 2e-8,
    # Metadata `kvlane calibrate` writes beside the coefficients; the sim ignores it.
    "fitted_on": {"model": "/tmp/tiny", "batch_sizes": [1, 2, 4], "max_num_seqs": 256},
    "fit_error": {"ttft_mape": 0.12, "itl_mape": 0.08},
}


def write(tmp_path: Path, document: object) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    return str(path)


def test_file_profile_loads_the_coefficients_and_ignores_the_metadata(tmp_path: Path) -> None:
    profile = get_profile("file:" + write(tmp_path, CALIBRATED))
    assert profile == StepTimeProfile(name="calibrated-tiny", a=0.002, b=1.5e-5, c=1e-4, d=2e-8)
    assert profile.step_seconds(100, 2, 300) == pytest.approx(0.002 + 1.5e-3 + 2e-4 + 6e-6)


def test_metadata_is_optional_and_d_defaults_to_zero(tmp_path: Path) -> None:
    document = {"name": "bare", "a": 1, "b": 0, "c": 0}  # ints are fine for float fields
    assert get_profile("file:" + write(tmp_path, document)) == StepTimeProfile(name="bare", a=1.0, b=0.0, c=0.0)


def test_per_request_terms_load_and_a_file_without_them_has_none(tmp_path: Path) -> None:
    older = get_profile("file:" + write(tmp_path, CALIBRATED))  # written before the per-request terms
    assert (older.per_request, older.per_output_token, older.lone_first_step) == (0.0, 0.0, False)
    assert older.step_seconds(100, 2, 300, new_requests=4, emitted_tokens=6) == older.step_seconds(100, 2, 300)
    document = CALIBRATED | {"per_request": 1.5e-4, "per_output_token": 2e-5, "lone_first_step": True}
    profile = get_profile("file:" + write(tmp_path, document))
    assert (profile.per_request, profile.per_output_token, profile.lone_first_step) == (1.5e-4, 2e-5, True)
    assert profile.step_seconds(100, 2, 300, new_requests=1, emitted_tokens=3) == pytest.approx(
        0.002 + 1.5e-3 + 2e-4 + 6e-6 + 1.5e-4 + 6e-5
    )


def test_quadratic_prefill_and_wake_latency_load_and_a_file_without_them_has_none(tmp_path: Path) -> None:
    older = get_profile("file:" + write(tmp_path, CALIBRATED))  # written before these terms
    assert (older.b2, older.wake_latency) == (0.0, 0.0)
    assert older.step_seconds(100, 2, 300, wakes=True) == older.step_seconds(100, 2, 300)
    profile = get_profile("file:" + write(tmp_path, CALIBRATED | {"b2": 3e-9, "wake_latency": 2.5e-3}))
    assert (profile.b2, profile.wake_latency) == (3e-9, 2.5e-3)
    plain = profile.step_seconds(100, 2, 300)
    assert plain == pytest.approx(0.002 + 1.5e-3 + 3e-5 + 2e-4 + 6e-6)
    assert profile.step_seconds(100, 2, 300, wakes=True) == pytest.approx(plain + 2.5e-3)
    # A step without tokens takes no time, woken or not.
    assert profile.step_seconds(0, 0, 0, wakes=True) == 0.0


def test_missing_file_is_a_clear_key_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ProfileFileError, match="cannot read") as info:
        get_profile(f"file:{missing}")
    # Callers (worker, balancer) already catch KeyError for unknown names.
    assert isinstance(info.value, KeyError)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(
    "document",
    [
        {k: v for k, v in CALIBRATED.items() if k != "a"},  # a coefficient missing
        CALIBRATED | {"b": "fast"},  # mistyped
        CALIBRATED | {"c": -1e-4},  # negative: a step could take negative time
        CALIBRATED | {"per_request": -1e-4},
        CALIBRATED | {"b2": -1e-9},
        CALIBRATED | {"wake_latency": -1e-3},
        CALIBRATED | {"speed": 2.0},  # unknown key: strict, a typo must not pass silently
        [1, 2, 3],  # not an object
    ],
    ids=["missing-a", "mistyped-b", "negative-c", "negative-per-request", "negative-b2", "negative-wake-latency",
         "unknown-key", "not-an-object"],
)
def test_invalid_profile_is_a_clear_key_error(tmp_path: Path, document: object) -> None:
    with pytest.raises(ProfileFileError, match="is not a valid profile"):
        get_profile("file:" + write(tmp_path, document))


def test_not_json_is_a_clear_key_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(KeyError, match="is not a valid profile"):
        get_profile(f"file:{path}")


def test_named_profiles_are_unchanged_and_unknown_names_mention_files() -> None:
    assert get_profile("tiny-cpu").name == "tiny-cpu"
    with pytest.raises(KeyError, match="file:<path>"):
        get_profile("nope")
