//! Runs whose ranks are processes: which rank this process is, read from the environment
//! its launcher gave it, and the meeting of the ranks (the rendezvous).
//!
//! The launchers, in the order they are looked for (an `srun torchrun ...` process is
//! torchrun's):
//! - torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, with `MASTER_ADDR` and `MASTER_PORT`;
//! - Open MPI's mpirun: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`;
//! - Slurm's srun: `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (or `SLURM_NTASKS`),
//!   `SLURM_LOCALID`, only inside a job step (`SLURM_STEP_ID`): an sbatch script itself has
//!   `SLURM_PROCID` 0 and the job's task count too, but is one process.
//!
//! mpirun and srun give no meeting point, so `MASTER_ADDR` (rank 0's machine) and
//! `MASTER_PORT` must be set for them, as torchrun's Slurm recipes do. Rank 0 opens its store
//! there; under torchrun, whose agent holds that port with a store of its own, rank 0 opens
//! any free port and leaves its address in torchrun's store (`torch_store`).

use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::Member;
use super::group::{Group, Remote, Store};
use super::torch_store::TorchStore;

/// This process's place in a run launched as processes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Who started the processes, for messages: "torchrun", "mpirun" or "srun".
    pub launcher: &'static str,
    pub rank: usize,
    pub world: usize,
    /// This process's index among the ranks of its machine: the GPU it drives.
    pub local_rank: usize,
    /// Rank 0's machine and the port of the meeting point.
    master: (String, u16),
    /// Whether the port is torchrun's own store (`TORCHELASTIC_USE_AGENT_STORE=True`), with
    /// the launcher's restart count, which keeps a restarted run off its last try's key.
    torch_agent: Option<String>,
}

/// The ranks met: this rank's membership, and on rank 0 the store it serves, which must
/// outlive the others' use of it (`Store::wait_for_the_others`).
pub struct Joined {
    pub member: Member,
    pub store: Option<Store>,
}

impl Launch {
    /// The launch this process is part of, from its environment; `None` where no launcher
    /// started it.
    pub fn from_env() -> Result<Option<Launch>> {
        Launch::from_vars(|name| std::env::var(name).ok())
    }

    /// `from_env` over any source of variables.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let number = |name: &str| -> Result<Option<usize>> {
            var(name)
                .map(|v| {
                    v.trim().parse::<usize>().with_context(|| {
                        format!("{name}={v}: not a rank or a count; check the launcher's command")
                    })
                })
                .transpose()
        };
        // Each launcher's names for (rank, world, local rank).
        let (launcher, names) = if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            ("torchrun", ["RANK", "WORLD_SIZE", "LOCAL_RANK"])
        } else if var("OMPI_COMM_WORLD_RANK").is_some() {
            let local = "OMPI_COMM_WORLD_LOCAL_RANK";
            (
                "mpirun",
                ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", local],
            )
        } else if var("SLURM_PROCID").is_some()
            && (var("SLURM_STEP_ID").or(var("SLURM_STEPID"))).is_some()
        {
            let world = ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]
                .into_iter()
                .find(|n| var(n).is_some())
                .unwrap_or("SLURM_NTASKS");
            ("srun", ["SLURM_PROCID", world, "SLURM_LOCALID"])
        } else {
            return Ok(None);
        };
        let values = (names.iter())
            .map(|name| {
                number(name)?.with_context(|| {
                    format!("{launcher} set some of its variables, but not {name}")
                })
            })
            .collect::<Result<Vec<usize>>>()?;
        let (rank, world, local_rank) = (values[0], values[1], values[2]);
        if world == 0 || rank >= world {
            bail!(
                "{}={rank} with {}={world}: a rank must be below the number of ranks",
                names[0],
                names[1]
            );
        }
        let master = match (var("MASTER_ADDR"), var("MASTER_PORT")) {
            _ if world == 1 => (String::new(), 0),
            (Some(addr), Some(port)) => {
                let port = port.trim().parse::<u16>().ok().filter(|&p| p > 0).with_context(|| {
                    format!("MASTER_PORT={port}: not a port; give a free TCP port of rank 0's machine, such as 29500")
                })?;
                (addr.trim().to_string(), port)
            }
            _ => bail!(
                "{launcher} started {world} ranks, but MASTER_ADDR and MASTER_PORT are not both \
                 set: they name rank 0's machine and a free port there, where the ranks meet \
                 (e.g. in an sbatch script: export MASTER_ADDR=$(scontrol show hostnames \
                 \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500; with mpirun, pass them \
                 with -x)"
            ),
        };
        let torch_agent = (launcher == "torchrun"
            && var("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True"))
        .then(|| var("TORCHELASTIC_RESTART_COUNT").unwrap_or_else(|| "0".into()));
        Ok(Some(Launch {
            launcher,
            rank,
            world,
            local_rank,
            master,
            torch_agent,
        }))
    }

    /// The ranks meet: rank 0 serves the store, the others join it. Their meetings, and this
    /// one, give up after `timeout`.
    pub fn join(&self, timeout: Duration) -> Result<Joined> {
        let (host, port) = (&self.master.0, self.master.1);
        let master = (host.as_str(), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .with_context(|| format!("MASTER_ADDR={host}: cannot resolve it to an address"))?;
        let mut torch = match &self.torch_agent {
            Some(_) => Some(TorchStore::connect(master, timeout)?),
            None => None,
        };
        let key = |restart: &String| format!("smelt/store/{restart}");
        if self.rank == 0 {
            // Under torchrun any free port, published; else MASTER_PORT itself.
            let listener = TcpListener::bind(("0.0.0.0", if torch.is_some() { 0 } else { port }))
                .with_context(|| {
                format!(
                    "rank 0: cannot open MASTER_PORT={port} for the ranks' store (another \
                         run on this machine may hold it); choose another MASTER_PORT"
                )
            })?;
            if let (Some(store), Some(restart)) = (&mut torch, &self.torch_agent) {
                let address = SocketAddr::new(store.local_ip()?, listener.local_addr()?.port());
                store.set(&key(restart), address.to_string().as_bytes())?;
            }
            let store = Store::serve(listener, self.world, timeout)?;
            let group: Arc<dyn Group> = store.group();
            return Ok(Joined {
                member: Member { rank: 0, group },
                store: Some(store),
            });
        }
        let address = match (&mut torch, &self.torch_agent) {
            (Some(store), Some(restart)) => {
                let value = store.get(&key(restart)).with_context(|| {
                    format!(
                        "rank {}: waiting for rank 0 to publish its store in torchrun's",
                        self.rank
                    )
                })?;
                let text = String::from_utf8_lossy(&value).into_owned();
                text.parse::<SocketAddr>().with_context(|| {
                    format!("torchrun's store holds `{text}` for rank 0's store, not an address")
                })?
            }
            _ => master,
        };
        let group: Arc<dyn Group> =
            Arc::new(Remote::join(address, self.rank, self.world, timeout)?);
        Ok(Joined {
            member: Member {
                rank: self.rank,
                group,
            },
            store: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Launch::from_vars(|name| vars.get(name).cloned())
    }

    const MASTER: [(&str, &str); 2] = [("MASTER_ADDR", "node0"), ("MASTER_PORT", "29500")];

    #[test]
    fn each_launchers_variables_give_the_rank() {
        assert_eq!(launch(&[]).unwrap(), None);
        let mut torchrun = vec![("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")];
        torchrun.extend(MASTER);
        let got = launch(&torchrun).unwrap().unwrap();
        assert_eq!(
            (got.launcher, got.rank, got.world, got.local_rank),
            ("torchrun", 3, 4, 1)
        );
        assert_eq!(got.master, ("node0".to_string(), 29500));
        assert_eq!(got.torch_agent, None);
        torchrun.extend([
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCHELASTIC_RESTART_COUNT", "2"),
        ]);
        assert_eq!(
            launch(&torchrun).unwrap().unwrap().torch_agent.as_deref(),
            Some("2")
        );

        let mut mpi = vec![
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ];
        mpi.extend(MASTER);
        let got = launch(&mpi).unwrap().unwrap();
        assert_eq!(
            (got.launcher, got.rank, got.world, got.local_rank),
            ("mpirun", 5, 8, 1)
        );

        let mut srun = vec![
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_ID", "0"),
        ];
        srun.extend(MASTER);
        let got = launch(&srun).unwrap().unwrap();
        assert_eq!(
            (got.launcher, got.rank, got.world, got.local_rank),
            ("srun", 2, 4, 0)
        );
        // An sbatch script outside any step is one process, whatever the job's tasks.
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "0"),
        ];
        assert_eq!(launch(&batch).unwrap(), None);
        // torchrun under srun is torchrun's.
        let mut both = srun.clone();
        both.extend([("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
        assert_eq!(launch(&both).unwrap().unwrap().launcher, "torchrun");
        // One rank needs no meeting point.
        let one = launch(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")]);
        assert_eq!(one.unwrap().unwrap().world, 1);
    }

    #[test]
    fn bad_or_missing_variables_are_named() {
        let err = |vars: &[(&str, &str)]| format!("{:#}", launch(vars).unwrap_err());
        let e = err(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
        assert!(e.contains("RANK=x: not a rank"), "{e}");
        let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2")]);
        assert!(
            e.contains("torchrun set some of its variables, but not LOCAL_RANK"),
            "{e}"
        );
        let e = err(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
        assert!(e.contains("RANK=2 with WORLD_SIZE=2"), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_ID", "0"),
        ]);
        assert!(
            e.contains("srun started 2 ranks, but MASTER_ADDR and MASTER_PORT"),
            "{e}"
        );
        let e = err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", "a"),
            ("MASTER_PORT", "0"),
        ]);
        assert!(e.contains("MASTER_PORT=0: not a port"), "{e}");
    }

    /// Two ranks meet through torchrun's store as the launcher's agent serves it.
    #[test]
    fn under_torchrun_rank_0_publishes_its_store_in_torchruns() {
        let port = crate::comm::torch_store::serve_like_c10d()
            .port()
            .to_string();
        let vars = |rank: &str| {
            let port = port.clone();
            let rank = rank.to_string();
            move |name: &str| {
                Some(match name {
                    "RANK" | "LOCAL_RANK" => rank.clone(),
                    "WORLD_SIZE" => "2".into(),
                    "MASTER_ADDR" => "127.0.0.1".into(),
                    "MASTER_PORT" => port.clone(),
                    "TORCHELASTIC_USE_AGENT_STORE" => "True".into(),
                    _ => return None,
                })
            }
        };
        let timeout = Duration::from_secs(60);
        std::thread::scope(|s| {
            let one = s.spawn(|| {
                let joined = Launch::from_vars(vars("1"))
                    .unwrap()
                    .unwrap()
                    .join(timeout)
                    .unwrap();
                let all = joined.member.group.exchange(1, vec![1.0]).unwrap();
                joined.member.group.end(1);
                all
            });
            let zero = Launch::from_vars(vars("0"))
                .unwrap()
                .unwrap()
                .join(timeout)
                .unwrap();
            let all = zero.member.group.exchange(0, vec![0.0]).unwrap();
            assert_eq!(*all, vec![vec![0.0], vec![1.0]]);
            assert_eq!(*one.join().unwrap(), vec![vec![0.0], vec![1.0]]);
            zero.store.unwrap().wait_for_the_others();
        });
    }
}
