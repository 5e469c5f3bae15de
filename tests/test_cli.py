"""`pagedjax bench`: runs a benchmark script of the source checkout with its own flags."""

from __future__ import annotations

import json

import pytest

from pagedjax import cli


def test_bench_runs_the_named_script_with_its_flags(tmp_path, monkeypatch):
    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "probe.py").write_text(
        "import json, sys\n"
        "from helper import VALUE\n"
        "if __name__ == '__main__':\n"
        "    out = sys.argv[sys.argv.index('--out') + 1]\n"
        "    open(out, 'w').write(json.dumps({'argv': sys.argv[1:], 'value': VALUE}))\n"
    )
    monkeypatch.setattr(cli, "BENCHMARKS", tmp_path)
    monkeypatch.setattr("sys.argv", ["pagedjax"])
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    out = tmp_path / "out.json"
    assert cli.main(["bench", "probe", "--requests", "3", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == {
        "argv": ["--requests", "3", "--out", str(out)],
        "value": 7,
    }


def test_bench_names_the_available_scripts_for_an_unknown_one():
    with pytest.raises(SystemExit, match="no benchmark 'nosuch'.*throughput"):
        cli.main(["bench", "nosuch"])


def test_generate_says_what_a_bad_option_needs(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    argv = ["generate", "--model", str(path), "-tp", "2", "w5"]
    with pytest.raises(SystemExit, match="pagedjax generate: .*needs 2 devices"):
        cli.main(argv)


def test_generate_takes_a_speculative_config_as_json(tiny_model_dir, capsys):
    path, _ = tiny_model_dir("llama")
    argv = ["generate", "--model", str(path), "--max-model-len", "64", "--no-chat-template"]
    argv += ["--max-tokens", "6", "w5 w6 w7 w5 w6 w7 w5 w6"]
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}'
    assert cli.main([*argv, "--speculative-config", spec]) == 0
    assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit, match="speculative_config: unknown keys \\['eagle'\\]"):
        cli.main([*argv, "--speculative-config", '{"num_speculative_tokens": 2, "eagle": 1}'])
    with pytest.raises(SystemExit, match="speculative_config: the draft model 'x' does not"):
        cli.main([*argv, "--speculative-config", '{"num_speculative_tokens": 2, "model": "x"}'])
    with pytest.raises(SystemExit):
        cli.main([*argv, "--speculative-config", "ngram"])  # not JSON: argparse's error


def test_generate_passes_dtype_and_gpu_memory_utilization_to_the_engine(tiny_model_dir):
    path, _ = tiny_model_dir("llama")
    argv = ["generate", "--model", str(path), "hi"]
    with pytest.raises(SystemExit, match="pagedjax generate: dtype must be one of"):
        cli.main([*argv, "--dtype", "int8"])
    with pytest.raises(SystemExit, match="pagedjax generate: gpu_memory_utilization must be"):
        cli.main([*argv, "--gpu-memory-utilization", "1.5"])
    with pytest.raises(SystemExit, match="pagedjax generate: int8_activations=True multiplies"):
        cli.main([*argv, "--int8-activations", "--dtype", "bfloat16"])
