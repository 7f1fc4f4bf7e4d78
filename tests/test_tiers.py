"""The test tiers' process guard (tests/conftest.py), run by pytester on tests of its own in this process.

A fast-tier test that starts a process fails naming the mark to add, also when the test swallows the
guard's failure; a test marked `slow`, and a session fixture, may start one.
"""

from __future__ import annotations

import pytest

CONFTEST = "from tests.conftest import pytest_configure  # noqa: F401 - the process guard\n"


def test_an_unmarked_test_that_starts_a_process_fails_naming_the_mark(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile("""
        import subprocess

        def test_runs_true():
            subprocess.run(["true"], check=True)

        def test_swallows_the_failure():
            try:
                subprocess.Popen(["true"]).wait()
            except BaseException:
                pass
    """)
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*test_runs_true started a process (subprocess 'true') but is in the fast "
                                 "tier: mark it @pytest.mark.slow*",
                                 "*test_swallows_the_failure started a process*mark it @pytest.mark.slow*"])


@pytest.mark.slow
def test_marked_tests_and_session_fixtures_may_start_processes(pytester):
    pytester.makeconftest(CONFTEST + """
import subprocess

import pytest


@pytest.fixture(scope="session")
def server():
    p = subprocess.Popen(["sleep", "30"])
    yield p
    p.kill()
    p.wait()
""")
    pytester.makepyfile("""
        import subprocess

        import pytest

        def test_uses_a_session_server(server):
            assert server.poll() is None

        @pytest.mark.slow
        def test_marked_runs_true():
            subprocess.run(["true"], check=True)
    """)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
