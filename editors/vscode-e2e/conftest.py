"""pytest plumbing for the VS Code end-to-end suite: TAP lines for editors/run-tests.sh, a
screenshot of the browser when a test fails, and a run folder (printed) that keeps the logs."""
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("DLM_E2E_ARTIFACTS") or REPO / ".cache/editors/e2e-artifacts" / time.strftime("%Y%m%d-%H%M%S"))


_config = None


def pytest_configure(config):
    global _config
    _config = config
    ARTIFACTS.mkdir(parents=True, exist_ok=True)


def pytest_report_header(config):
    return f"vscode-e2e: screenshots and logs in {ARTIFACTS}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "vs" in item.funcargs:
        shot = ARTIFACTS / f"FAILED-{item.name}.png"
        try:
            item.funcargs["vs"].page.screenshot(path=str(shot))
            report.sections.append(("screenshot", str(shot)))
        except Exception as e:  # noqa: BLE001 - a dead browser must not hide the test's own failure
            report.sections.append(("screenshot", f"none: {e}"))


def pytest_runtest_logreport(report):
    """Prints one TAP line per test ("ok - name" / "not ok - name"), which run-tests.sh counts."""
    name = report.nodeid.split("::")[-1]
    line = None
    if report.when == "call":
        line = f"{'ok' if report.passed else 'not ok'} - vscode: {name}"
    elif report.when == "setup" and not report.passed:
        line = f"not ok - vscode: {name} (setup: {'skipped' if report.skipped else 'error'})"
    reporter = _config and _config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter:
        reporter.ensure_newline()
        reporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    print(f"\nvscode-e2e: screenshots and logs in {ARTIFACTS}", flush=True)
