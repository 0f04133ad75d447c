import os
import re
import time
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from conftest import REPO, write_sheet

from slidesnake.cohort.samples import SAFE_ID, read_sample_sheet, sheet_warnings
from slidesnake.errors import SampleSheetError
from slidesnake.side_files import MAX_BYTES
from slidesnake.tiling.grid import TileParams
from slidesnake.tiling.tissue import TissueParams


def test_good_sheet_is_indexed_by_slide_id(tmp_path):
    (tmp_path / "a.svs").touch()
    (tmp_path / "b.tif").touch()
    sheet = write_sheet(tmp_path / "s.tsv", [("a", "a.svs"), ("b-2.x", "b.tif", 0.25)])
    samples = read_sample_sheet(sheet, base_dir=tmp_path)
    assert list(samples.index) == ["a", "b-2.x"]
    assert samples.loc["b-2.x", "mpp"] == 0.25
    assert samples["mpp"].isna().sum() == 1


def test_every_problem_is_reported_at_once(tmp_path):
    (tmp_path / "ok.svs").touch()
    rows = [
        ("ok", "ok.svs"),
        ("ok", "ok.svs"),
        ("../evil", "ok.svs"),
        ("has space", "ok.svs"),
        ("sub/dir", "ok.svs"),
        ("-rf", "ok.svs"),
        ("dir", "."),
        ("bad-mpp", "ok.svs", "352.7"),
    ]
    with pytest.raises(SampleSheetError) as err:
        read_sample_sheet(write_sheet(tmp_path / "s.tsv", rows), base_dir=tmp_path)
    message = str(err.value)
    assert "slide_id 'ok' appears more than once" in message
    for bad in ("'../evil'", "'has space'", "'sub/dir'", "'-rf'"):
        assert f"slide_id {bad} is not a portable file name" in message
    assert "slide 'dir': . is a directory" in message
    assert "slide 'bad-mpp': mpp '352.7' is not a number of microns per pixel" in message


def test_a_sheet_with_a_final_newline_in_an_id_is_refused(tmp_path):
    (tmp_path / "a.svs").touch()
    sheet = tmp_path / "s.tsv"
    sheet.write_text('slide_id\tpath\n"A1\n"\ta.svs\n')
    with pytest.raises(SampleSheetError, match=r"slide_id 'A1\\n' is not a portable file name"):
        read_sample_sheet(sheet, base_dir=tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "huge"])
def test_a_sheet_that_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path, kind):
    """A FIFO would block the dry run and doctor for ever, /dev/zero fill their memory."""
    sheet = tmp_path / "samples.tsv"
    if kind == "fifo":
        os.mkfifo(sheet)
    elif kind == "device":
        sheet = Path("/dev/zero")
    elif kind == "directory":
        sheet.mkdir()
    else:
        with open(sheet, "wb") as f:
            f.truncate(MAX_BYTES["samples"] + 1)  # sparse: no disk used
    started = time.monotonic()
    with pytest.raises(SampleSheetError, match=f"sample sheet {sheet}: .*give a tab-separated"):
        read_sample_sheet(sheet, base_dir=tmp_path)
    assert time.monotonic() - started < 1


def test_sheet_without_required_columns(tmp_path):
    sheet = tmp_path / "s.tsv"
    sheet.write_text("id\tfile\nx\ty\n")
    with pytest.raises(SampleSheetError, match="missing column"):
        read_sample_sheet(sheet)


@pytest.mark.parametrize(
    ("slide_id", "safe"),
    [
        ("TCGA-AA-3502", True),
        ("a.b_c-1", True),
        ("_x", True),
        (".hidden", False),
        ("a..b", False),
        ("..", False),
        ("a/b", False),
        ("a b", False),
        ("", False),
        ("é", False),
        ("-x", False),
        ("a" * 128, True),
        ("a" * 129, False),
        ("A1\n", False),  # a `$` anchor matches before a final newline
        ("A1\r\n", False),
        ("\nA1", False),
    ],
)
def test_schema_and_package_agree_on_safe_ids(slide_id, safe):
    schema = yaml.safe_load((REPO / "workflow/schemas/samples.schema.yaml").read_text())
    pattern = schema["properties"]["slide_id"]["pattern"]
    assert bool(re.search(pattern, slide_id)) is safe
    assert bool(SAFE_ID.fullmatch(slide_id)) is safe


def test_config_defaults_match_the_package_defaults():
    config = yaml.safe_load((REPO / "config/config.yaml").read_text())
    for section, params in (("tissue", TissueParams), ("tiles", TileParams)):
        assert set(config[section]) == {f.name for f in fields(params)}
        assert params.from_mapping(config[section]) == params()


def test_nested_config_overrides_get_their_yaml_types():
    from slidesnake.cohort.config import typed_sections

    config = {"samples": "123", "tiles": {"stride": "112", "mpp": "0.5", "x": "null", "n": "a"}}
    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    assert typed_sections(config, schema) == {
        "samples": "123",
        "tiles": {"stride": 112, "mpp": 0.5, "x": None, "n": "a"},
    }


def test_urls_are_slides_in_stores_but_never_with_their_credentials(tmp_path):
    rows = [
        ("s3", "s3://bucket/a.svs"),
        ("web", "https://slides.example.org/b.svs"),
        ("userinfo", "https://reader:pa55@slides.example.org/c.svs"),
        ("signed", "https://bucket.s3.amazonaws.com/d.svs?X-Amz-Signature=abc"),
        ("token", "https://tok3n@slides.example.org/e.svs"),
        ("fragment", "https://slides.example.org/f.svs#access_token=frag5ecret"),
        ("session", "https://slides.example.org/g.svs;jsessionid=5ess10n"),
        ("segment", "https://slides.example.org/dir;sid=5egment/h.svs"),
        ("bare", "https://slides.example.org/i.svs?"),
    ]
    with pytest.raises(SampleSheetError) as caught:
        read_sample_sheet(write_sheet(tmp_path / "s.tsv", rows))
    message = str(caught.value)
    for refused in ("userinfo", "signed", "token", "fragment", "session", "segment", "bare"):
        assert f"slide '{refused}': the URL may carry credentials" in message
    assert "'s3'" not in message and "'web'" not in message
    for secret in ("pa55", "abc", "tok3n", "frag5ecret", "5ess10n", "5egment"):
        assert secret not in message
    sheet = read_sample_sheet(write_sheet(tmp_path / "ok.tsv", rows[:2]))
    assert list(sheet["path"]) == ["s3://bucket/a.svs", "https://slides.example.org/b.svs"]
    assert sheet_warnings(sheet) == []  # a URL is not a missing file
