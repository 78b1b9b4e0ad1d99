"""`first_error`: what a failed child's log shows in a start-up error (the launch tests see it
through a whole stand-in Gym deployment; these the log shapes one by one)."""

import pytest

from nemo_gym_ext.processes import LOG_TAIL_CHARS, first_error


@pytest.mark.parametrize(
    ("log", "expected"),
    [
        (  # a traceback among other lines: from its start to the line naming the exception
            'starting\nTraceback (most recent call last):\n  File "a.py", line 1\n'
            "    except ImportError: pass\nImportError: cannot import name 'x'\nmore\n"
            "ValueError: a later one\n",
            'Traceback (most recent call last):\n  File "a.py", line 1\n'
            "    except ImportError: pass\nImportError: cannot import name 'x'",
        ),
        (  # without a traceback, the first line naming an error
            "ok\n(pid=4) OSError: [Errno 98] Address already in use\nRuntimeError: later\n",
            "(pid=4) OSError: [Errno 98] Address already in use",
        ),
        ("everything went fine\nan error-free line: no Error here\n", None),
    ],
    ids=["traceback", "error_line", "none"],
)
def test_the_first_error_of_a_log(tmp_path, log, expected):
    path = tmp_path / "log"
    path.write_text(log)
    assert first_error(path) == expected


def test_a_traceback_without_an_end_is_cut_to_forty_lines_and_the_tail_size(tmp_path):
    path = tmp_path / "log"
    frames = "".join(f'  File "f{i}.py", line {i}, {"x" * 200}\n' for i in range(100))
    path.write_text("Traceback (most recent call last):\n" + frames)
    shown = first_error(path)
    assert shown is not None and shown.startswith("Traceback")
    assert len(shown) <= LOG_TAIL_CHARS and len(shown.splitlines()) <= 40
