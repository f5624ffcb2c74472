"""Shared by the command-line tests: run an entry point in-process and check one-line errors."""


def run_main(main, capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(main, capsys, message, *argv):
    code, out, err = run_main(main, capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert "Traceback" not in err
