import dataclasses
from typing import ClassVar

import pytest

from pocketdiff.config import DataConfig, load_config, with_overrides
from pocketdiff.errors import ConfigError


@dataclasses.dataclass
class Inner:
    lr: float = 1e-3
    steps: int = 10


@dataclasses.dataclass
class Schema:
    name: str = "x"
    inner: Inner = dataclasses.field(default_factory=Inner)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_and_overrides_merge_typed(tmp_path):
    p = write(tmp_path, "inner:\n  lr: 0.5\ndata:\n  resolution: 64\n")
    cfg = load_config(Schema, p, ["inner.steps=7", "name=abc"])
    assert isinstance(cfg, Schema) and isinstance(cfg.inner, Inner)
    assert cfg.inner.lr == 0.5 and cfg.inner.steps == 7 and cfg.name == "abc"
    assert cfg.data.resolution == 64


def test_unknown_key_names_key_and_file(tmp_path):
    p = write(tmp_path, "inner:\n  lrr: 0.5\n", name="recipe.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(Schema, p)
    assert "recipe.yaml" in str(e.value) and "inner.lrr" in str(e.value)


def test_wrong_type_names_key_and_file(tmp_path):
    p = write(tmp_path, "inner:\n  steps: many\n", name="typed.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(Schema, p)
    assert "typed.yaml" in str(e.value) and "inner.steps" in str(e.value)


def test_override_unknown_key_and_bad_form(tmp_path):
    with pytest.raises(ConfigError, match="inner.nope"):
        load_config(Schema, None, ["inner.nope=1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(Schema, None, ["inner.lr"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Schema, tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(Schema, write(tmp_path, "inner: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(Schema, write(tmp_path, "- 1\n- 2\n"))


def test_value_validation_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="data.source"):
        load_config(Schema, write(tmp_path, "data:\n  source: nowhere\n"))
    with pytest.raises(ConfigError, match="data.path"):
        load_config(Schema, None, ["data.source=imagefolder"])


@dataclasses.dataclass
class WithList:
    prompts: list[str] = dataclasses.field(default_factory=list)


def test_list_element_type_is_checked(tmp_path):
    p = write(tmp_path, "prompts:\n  - ok\n  - flag: Germany\n", name="lists.yaml")
    with pytest.raises(ConfigError, match="lists.yaml"):
        load_config(WithList, p)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(lr=st.floats(1e-8, 10, allow_nan=False), steps=st.integers(0, 10**6), name=st.text(
    alphabet=st.characters(whitelist_categories=("Ll", "Lu", "Nd")), min_size=1, max_size=12))
def test_overrides_round_trip_any_valid_value(lr, steps, name):
    cfg = load_config(Schema, None, [f"inner.lr={lr!r}", f"inner.steps={steps}", f"name={name}"])
    assert cfg.inner.lr == float(repr(lr)) and cfg.inner.steps == steps and cfg.name == name


@settings(max_examples=40, deadline=None)
@given(key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=10))
def test_any_unknown_key_is_named(key):
    if key in ("lr", "steps"):
        return
    with pytest.raises(ConfigError, match=f"inner.{key}"):
        load_config(Schema, None, [f"inner.{key}=1"])


def test_string_overrides_keep_their_text_and_null_means_none_where_optional():
    cfg = load_config(Schema, None, ["name=007", "data.caption_column=yes"])
    assert cfg.name == "007" and cfg.data.caption_column == "yes"
    assert load_config(Schema, None, ["data.path=null"]).data.path is None
    assert load_config(Schema, None, ["data.path=00"]).data.path == "00"


def test_with_overrides_starts_from_the_given_instance_and_checks_like_the_command_line():
    base = Schema(name="kept", inner=Inner(lr=0.25, steps=3))
    cfg = with_overrides(base, ["inner.steps=9", "data.resolution=48"])
    assert (cfg.name, cfg.inner.lr, cfg.inner.steps, cfg.data.resolution) == ("kept", 0.25, 9, 48)
    assert base.inner.steps == 3 and base.data.resolution == 32  # the given instance is not changed
    with pytest.raises(ConfigError, match="inner.nope"):
        with_overrides(base, ["inner.nope=1"])
    with pytest.raises(ConfigError, match="inner.steps"):
        with_overrides(base, ["inner.steps=many"])
    with pytest.raises(ConfigError, match="data.resolution"):  # __post_init__ validation runs
        with_overrides(base, ["data.resolution=2"])


@dataclasses.dataclass
class Renamed:
    RENAMED_KEYS: ClassVar[dict] = {"inner.lr": "inner.rate"}
    inner: "RenamedInner" = dataclasses.field(default_factory=lambda: RenamedInner())


@dataclasses.dataclass
class RenamedInner:
    rate: float = 1.0


def test_an_old_key_is_accepted_with_one_deprecation_line(tmp_path, capsys):
    cfg = load_config(Renamed, write(tmp_path, "inner:\n  lr: 0.5\n"))
    assert cfg.inner.rate == 0.5
    assert with_overrides(cfg, ["inner.lr=0.25"]).inner.rate == 0.25
    load_config(Renamed, write(tmp_path, "inner:\n  lr: 0.5\n"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert lines == ["warning: inner.lr is deprecated, use inner.rate"]
    assert load_config(Renamed, write(tmp_path, "inner:\n  lr: 0.5\n  rate: 2\n")).inner.rate == 2  # the new key wins
