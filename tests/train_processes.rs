//! Ranks as processes, started as launchers start them: each `smelt train` process is given
//! a launcher's variables (torchrun's, srun's or mpirun's) on 127.0.0.1, and the CPU ranks
//! exchange over TCP through rank 0's store. They must train bit for bit as the same run on
//! `--gpus 2` threads, and a rank killed mid-run must stop the others, naming it.

mod train_support;

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use train_support::*;

/// A port that was free a moment ago, for MASTER_PORT.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Each launcher's variables for rank `rank` of `world`, with the meeting point.
fn launcher_vars(launcher: &str, rank: usize, world: usize, port: u16) -> Vec<(String, String)> {
    let names: &[&str] = match launcher {
        "torchrun" => &["RANK", "WORLD_SIZE", "LOCAL_RANK"],
        "srun" => &["SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"],
        "mpirun" => &[
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
        ],
        _ => unreachable!(),
    };
    let mut vars: Vec<(String, String)> = names
        .iter()
        .zip([rank, world, rank])
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    if launcher == "srun" {
        vars.push(("SLURM_STEP_ID".into(), "0".into()));
    }
    vars.push(("MASTER_ADDR".into(), "127.0.0.1".into()));
    vars.push(("MASTER_PORT".into(), port.to_string()));
    vars
}

/// Starts `world` processes of `smelt args` as `launcher` would (each on its own GPU were
/// there one; here CPU ranks).
fn launch(launcher: &str, world: usize, args: &[String]) -> Vec<Child> {
    let port = free_port();
    (0..world)
        .map(|rank| {
            Command::new(SMELT)
                .args(args)
                .envs(launcher_vars(launcher, rank, world, port))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

fn wait(children: Vec<Child>) -> Vec<Output> {
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

/// A 6-step CPU run of the tiny model in `dir`, batch 2 per rank, with bf16 weights rounded
/// stochastically from an f32 master and bf16 moments (so that any difference between the
/// ranks' replicas shows in the bits), a checkpoint every 3 steps, and `extra` flags.
fn args(set: &Setup, dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut flags = vec!["--device", "cpu"];
    for (flag, value) in [("--steps", "6"), ("--ckpt-interval", "3")] {
        if !extra.contains(&flag) {
            flags.extend([flag, value]);
        }
    }
    flags.extend(["--model-dtype", "bf16", "--opt-m-dtype", "bf16"]);
    flags.extend(["--eval-file", s(&set.data)]);
    flags.extend(extra);
    run_args(set, dir, &flags)
}

/// The run in `dir` is the run in `reference`, bit for bit: its steps' losses and data, its
/// checkpoints and its exported model.
fn assert_same_run(reference: &Path, dir: &Path) {
    assert_eq!(
        steps(&reference.join("log.jsonl")),
        steps(&dir.join("log.jsonl"))
    );
    for step in [3, 6] {
        let ckpt = |d: &Path| smelt::train::checkpoint::step_dir(&d.join("ckpt"), step);
        assert_eq!(
            checkpoint_files(&ckpt(reference)),
            checkpoint_files(&ckpt(dir)),
            "step {step}"
        );
    }
    assert!(
        std::fs::read(reference.join("out/model.safetensors")).unwrap()
            == std::fs::read(dir.join("out/model.safetensors")).unwrap(),
        "the exported models differ"
    );
}

#[test]
fn processes_of_every_launcher_train_as_threads_do_bit_for_bit() {
    let set = setup();
    for zero in ["0", "2", "3"] {
        let threads = set.root.join(format!("threads-zero{zero}"));
        smelt_ok(&strs(&args(
            &set,
            &threads,
            &["--gpus", "2", "--zero-level", zero],
        )));
        for launcher in ["torchrun", "srun", "mpirun"] {
            let dir = set.root.join(format!("{launcher}-zero{zero}"));
            let outputs = wait(launch(
                launcher,
                2,
                &args(&set, &dir, &["--zero-level", zero]),
            ));
            for (rank, out) in outputs.iter().enumerate() {
                assert!(
                    out.status.success(),
                    "{launcher}, rank {rank}:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            let stdout = String::from_utf8_lossy(&outputs[0].stdout);
            assert!(stdout.contains("(rank 0 of 2)"), "{stdout}");
            assert_same_run(&threads, &dir);
        }
    }
}

/// Polls `child` until it ends, for at most `limit`.
fn ends_within(child: &mut Child, limit: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if child.try_wait().unwrap().is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// SIGKILL one rank in the middle of a run: the other exits non-zero within --comm-timeout,
/// its error naming the killed rank, whichever of the two it was.
#[test]
fn a_rank_killed_mid_run_stops_the_other_naming_it() {
    let set = setup();
    for (killed, expected) in [
        (1, "rank 1 (of 2) failed: its process ended without a word"),
        (0, "rank 0 (of 2) failed: the connection to its store broke"),
    ] {
        let dir = set.root.join(format!("killed-{killed}"));
        let flags = [
            "--steps",
            "100000",
            "--comm-timeout",
            "20",
            "--ckpt-interval",
            "0",
        ];
        let mut ranks = launch("torchrun", 2, &args(&set, &dir, &flags));
        let log = dir.join("log.jsonl");
        let start = Instant::now();
        while !std::fs::read_to_string(&log).is_ok_and(|l| l.contains(r#""event":"step""#)) {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no step was logged"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        ranks[killed].kill().unwrap();
        let mut other = ranks.remove(1 - killed);
        assert!(
            ends_within(&mut other, Duration::from_secs(20)),
            "rank {} did not stop within --comm-timeout",
            1 - killed
        );
        let out = other.wait_with_output().unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{stderr}");
        for mut rank in ranks {
            rank.wait().unwrap();
        }
    }
}

/// A launched process refuses what cannot be: several GPUs of its own, or a world that its
/// peer counts otherwise; each with the variable or flag named.
#[test]
fn launched_processes_refuse_gpus_and_mismatched_worlds() {
    let set = setup();
    let dir = set.root.join("gpus");
    let mut cmd = Command::new(SMELT);
    cmd.args(args(&set, &dir, &["--gpus", "2"]))
        .envs(launcher_vars("torchrun", 0, 2, free_port()));
    let out = cmd.output().unwrap();
    let err = assert_refused(&out, &["--gpus 2", "rank 0 of the 2 that torchrun started"]);
    assert!(!err.contains("panicked"), "{err}");

    let dir = set.root.join("worlds");
    let port = free_port();
    let flags = ["--comm-timeout", "5"];
    let zero = Command::new(SMELT)
        .args(args(&set, &dir, &flags))
        .envs(launcher_vars("torchrun", 0, 2, port))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let other = Command::new(SMELT)
        .args(args(&set, &dir, &flags))
        .envs(launcher_vars("torchrun", 1, 3, port))
        .output()
        .unwrap();
    assert_refused(
        &other,
        &["rank 1 counts 3 ranks, rank 0 counts 2", "WORLD_SIZE"],
    );
    // Rank 0 waits for a rank 1 that never comes, and says so within the timeout.
    let out = zero.wait_with_output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("waited 5 s for rank(s) 1"), "{stderr}");
}
