"""launch/slurm.sbatch's last line as a user reads it in the job's output.

- The time-limit requeue: the tasks' own last lines say "re-run the same command to resume"
  (they cannot know the job requeues itself), and Slurm follows the script's line with "*** JOB
  N ... CANCELLED ... DUE TO JOB REQUEUE ***". The script's line must say that the job starts
  again by itself: a resubmitted job would train beside the requeued one, in the same workdir.
- A task killed by a signal (a node lost, the out-of-memory killer): the survivors' errors fill
  the output, and the line said "failed with status 137 (2: a user error; 1: a crash; see
  above)", neither of which it was. It must name the task that ended first and how.

The script runs under plain bash with test_slurm.py's stand-ins for Slurm's commands.
"""

from test_slurm import fake_slurm, script_in_fake_slurm, signalled_early

# srun whose tasks train until the warning's SIGTERM, then save and exit 0 (what they say is
# theirs: only the script's lines are under test).
SAVING_SRUN = """#!/bin/sh
echo $$ > "$FAKE/srun.pid"
sleep 120 &
trap 'kill $!; exit 0' TERM
wait
"""


def test_the_time_limit_requeue_line_says_the_job_comes_back_by_itself(repo_root, tmp_path):
    env = fake_slurm(tmp_path, srun=SAVING_SRUN)
    env.update(signalled_early(tmp_path, "USR1", before="wait "))
    done = script_in_fake_slurm(repo_root, env)
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("slurm.sbatch: ")]
    assert lines[-1] == (
        "slurm.sbatch: time limit near: every task saved and stopped; requeueing job 123 to "
        "resume from the latest checkpoint; it starts again by itself, so do not resubmit it "
        "(Slurm's line '*** JOB 123 ... CANCELLED ... DUE TO JOB REQUEUE ***' is this requeue)"
    ), done.stderr
    assert (tmp_path / "calls").read_text().splitlines()[-1] == "scontrol requeue 123"


# srun as it ends when one task is SIGKILLed and the others abort in their next collective
KILLED_SRUN = """#!/bin/sh
echo "srun: error: node7: task 2: Killed" >&2
echo "srun: error: node7: tasks 0-1,3: Aborted" >&2
exit 137
"""


def test_a_task_killed_first_is_named_with_how_it_ended(repo_root, tmp_path):
    env = fake_slurm(tmp_path, srun=KILLED_SRUN)
    done = script_in_fake_slurm(repo_root, env)
    assert done.returncode == 137, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "slurm.sbatch: the training step failed: node7: task 2: Killed, before any other task "
        "ended (a signal: the host's out-of-memory killer, a node lost, or a kill by hand; the "
        "other tasks' errors above follow from it); not requeueing: resubmit the same command "
        "to resume from the latest checkpoint"
    ), done.stderr
