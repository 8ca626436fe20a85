"""matplotlib gets a folder of the tool's own (MPLCONFIGDIR), so rendering writes nothing under the user's home."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("from auditor._env import configure_matplotlib\nd = configure_matplotlib()\nimport matplotlib\n"
        "matplotlib.use('Agg')\nimport matplotlib.pyplot as plt\nplt.subplots()\nprint(d)\n"
        "print(matplotlib.get_configdir())\nprint(matplotlib.get_cachedir())\n"
        "print(configure_matplotlib())\n")


def run(env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                                                              "LOWRANK_AUDITOR_CACHE")}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), **env_extra)
    (tmp_path / "home").mkdir(exist_ok=True)
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split("\n")


def test_matplotlib_folder_under_the_tool_cache_and_nothing_in_home(tmp_path):
    chosen, config, cache, again, _ = run({"LOWRANK_AUDITOR_CACHE": str(tmp_path / "cache")}, tmp_path)
    assert chosen == config == cache == again == str(tmp_path / "cache" / "matplotlib")
    assert list((tmp_path / "home").iterdir()) == []  # no ~/.config/matplotlib, no ~/.cache/matplotlib
    assert any(p.name.startswith("fontlist") for p in (tmp_path / "cache" / "matplotlib").iterdir())
    chosen, *_ = run({}, tmp_path)  # default: ~/.cache/lowrank-auditor/matplotlib, the tool's own folder
    assert chosen == str(tmp_path / "home" / ".cache" / "lowrank-auditor" / "matplotlib")
    assert [p.name for p in (tmp_path / "home" / ".cache").iterdir()] == ["lowrank-auditor"]


def test_user_setting_kept_and_unwritable_cache_falls_back_to_a_temporary_folder(tmp_path):
    mine = tmp_path / "mine"
    chosen, config, *_ = run({"MPLCONFIGDIR": str(mine)}, tmp_path)
    assert chosen == config == str(mine)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    chosen, config, *_ = run({"LOWRANK_AUDITOR_CACHE": str(blocker)}, tmp_path)
    assert chosen == config and Path(chosen).name.startswith("lowrank-auditor-matplotlib-")


def test_too_late_once_matplotlib_is_imported(monkeypatch):
    from auditor._env import configure_matplotlib

    monkeypatch.delenv("MPLCONFIGDIR", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", object())
    assert configure_matplotlib() is None and "MPLCONFIGDIR" not in os.environ
