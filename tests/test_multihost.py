"""``dspark_jax.multihost``: two processes on this machine joined as one multi-host JAX run (the
whole training pipeline run that way is in ``test_train.py``)."""

import json
import textwrap

import pytest

from dspark_jax import multihost
from dspark_jax.cli import main as cli_main
from tests.multidevice import run_processes

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import jax
    from dspark_jax import multihost
    from dspark_jax.training.train import make_mesh
    args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    multihost.initialize(args["--coordinator"], int(args["--num-processes"]), int(args["--process-id"]))
    me = jax.process_index()
    # Each process offers its own values; every process gets the lead's.
    agreed = multihost.lead_value((10 + me, 0.5 + me, me == 0))
    if me == 1:
        time.sleep(2)  # the lead must wait here for the other
    start = time.monotonic()
    multihost.barrier("test")
    try:
        make_mesh(2)
        refused = None
    except ValueError as error:
        refused = str(error)
    print(json.dumps({"process": me, "lead": multihost.is_lead(), "agreed": list(agreed),
                      "shards": multihost.share(range(5)), "waited": time.monotonic() - start,
                      "mesh": make_mesh(None).size, "local_mesh": make_mesh(None, local=True).size,
                      "refused": refused}))
""")


def test_two_processes_agree_on_the_lead_value_split_shards_and_meet_at_barriers():
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in run_processes(["-c", SCRIPT])]
    assert [r["process"] for r in reports] == [0, 1]
    assert [r["lead"] for r in reports] == [True, False]
    assert [r["agreed"] for r in reports] == [[10, 0.5, True]] * 2
    assert [r["shards"] for r in reports] == [[0, 2, 4], [1, 3]]
    assert reports[0]["waited"] > 1.0  # the barrier held the lead until the other arrived
    assert [(r["mesh"], r["local_mesh"]) for r in reports] == [(4, 2)] * 2
    assert all("every device takes part" in r["refused"] for r in reports)


def test_one_process_is_its_own_lead():
    assert multihost.is_lead()
    assert multihost.lead_value((3, 0.25)) == (3, 0.25)
    assert multihost.share(range(3)) == [0, 1, 2]
    assert multihost.share("abcde", 1, 2) == ["b", "d"]  # another process's share, named
    multihost.barrier("alone")  # returns at once


@pytest.mark.parametrize("given", [["--coordinator", "localhost:1"], ["--num-processes", "2", "--process-id", "0"]])
def test_train_refuses_a_partial_process_list(given, capsys):
    assert cli_main(["train", "--config", "configs/tiny_test.py", *given]) == 2
    assert "together" in capsys.readouterr().err


def test_train_refuses_a_process_id_outside_the_run(capsys):
    args = ["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"]
    assert cli_main(["train", "--config", "configs/tiny_test.py", *args]) == 2
    assert "process id 2 is not in 0..1" in capsys.readouterr().err
