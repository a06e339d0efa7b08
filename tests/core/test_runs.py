"""Run folders: atomic, self-describing, resumable, never silently replaced; configs replay."""

from dataclasses import dataclass, field

import pytest

from assay.core.config import DataConfig, ModelConfig
from assay.core.errors import AssayError
from assay.core.runs import RunFolder, config_from_dict, config_to_dict, final_location, read_json, run_folder


@dataclass
class _Cfg:
    out: str
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    modules: tuple[str, ...] = ("a*",)
    overwrite: bool = False


def test_config_json_round_trip():
    model = ModelConfig(lora_rank=4, lora_modules=("q_proj",))
    cfg = _Cfg(out="x", model=model, data=DataConfig(max_samples=3))
    assert config_from_dict(_Cfg, config_to_dict(cfg)) == cfg


def test_outputs_appear_only_when_finished(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with run_folder(out, "test", _Cfg(out=str(out))) as run:
            (run.path / "partial.txt").write_text("half")
            raise RuntimeError("killed")
    assert not out.exists() and (tmp_path / "run.part" / "partial.txt").exists()
    with run_folder(out, "test", _Cfg(out=str(out))) as run:
        assert run.resumed and (run.path / "partial.txt").exists()
    assert (out / "run.json").exists() and not (tmp_path / "run.part").exists()
    saved = read_json(out / "config.json")
    assert saved["command"] == "test" and "assay_version" in saved


def test_finished_run_is_not_overwritten_without_asking(tmp_path):
    out = tmp_path / "run"
    with run_folder(out, "test", _Cfg(out=str(out))) as run:
        (run.path / "result.txt").write_text("first")
    with pytest.raises(AssayError, match="--overwrite"):
        RunFolder(out, "test", _Cfg(out=str(out))).open()
    with run_folder(out, "test", _Cfg(out=str(out)), overwrite=True) as run:
        (run.path / "result.txt").write_text("second")
    assert (out / "result.txt").read_text() == "second"


def test_resume_refuses_other_settings_by_name(tmp_path):
    out = tmp_path / "run"
    first = RunFolder(out, "test", _Cfg(out=str(out))).open()
    (first.path / "rows.npy").write_bytes(b"work")  # something a rerun would reuse
    first.close()
    with pytest.raises(AssayError, match=r"another --modules \(\['a\*'\], now \['b\*'\]\).*assay replay"):
        RunFolder(out, "test", _Cfg(out=str(out), modules=("b*",))).open()


def test_messages_name_a_stage_where_it_will_be_once_its_parent_run_finishes(tmp_path):
    @dataclass
    class Cfg:
        n: int = 1

    with run_folder(tmp_path / "demo", "demo", Cfg()) as parent:
        stage = parent.path / "index"  # a stage writes inside the parent's .part
        assert parent.path.name == "demo.part"
        assert final_location(stage) == tmp_path / "demo" / "index"
        with run_folder(stage, "build", Cfg()) as inner:
            assert final_location(inner.path) == tmp_path / "demo" / "index"
    assert (tmp_path / "demo" / "index").is_dir()
    # a folder that merely ends in .part, with no run in it, keeps its name
    (tmp_path / "notes.part").mkdir()
    assert final_location(tmp_path / "notes.part" / "x") == tmp_path / "notes.part" / "x"


def _write_often(path: str, rank: int, rounds: int) -> None:
    from pathlib import Path

    from assay.core.runs import write_json, write_jsonl

    for i in range(rounds):
        write_json(Path(path), {"rank": rank, "i": i})
        write_jsonl(Path(path + "l"), [{"rank": rank, "i": i}])


def test_concurrent_writers_of_one_file_never_fail(tmp_path):
    """What every torchrun rank does when it writes the same summary: each write stays atomic and
    none fails (with one shared temporary name, one rank's rename took the other's file away)."""
    import multiprocessing as mp

    path = tmp_path / "summary.json"
    procs = [mp.get_context("fork").Process(target=_write_often, args=(str(path), r, 400)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert read_json(path)["i"] == 399  # whole, from whichever rank replaced it last
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["summary.json", "summary.jsonl"]  # no temporaries left behind
