"""The README's two commands are the ones the scripts and CI run (no drift)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Two commands\s+```bash\n(.*?)```", text, re.S)
    assert block, "README has no '## Two commands' bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_gives_exactly_two_commands_that_exist():
    cmds = readme_commands()
    assert cmds == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    for cmd in cmds:
        assert (ROOT / cmd.split()[1]).is_file()


def test_ci_runs_the_readme_test_command():
    ci = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines() if l.strip() and not l.startswith("#")]
    assert readme_commands()[1] in ci


def test_both_commands_set_up_the_venv_first():
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        body = (ROOT / script).read_text()
        assert "bash scripts/setup.sh" in body
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert setup.index("torch==2.13.0") < setup.index("-e \".[all]\"")
    assert "-c scripts/constraints.txt" in setup
    assert "torch==2.13.0" in (ROOT / "scripts" / "constraints.txt").read_text()
