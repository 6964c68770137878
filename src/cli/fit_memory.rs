//! `--fit-memory`, shared by `smelt train` and `smelt bench`: the memory flags that `smelt
//! plan` would pick for the run, within a budget per device.

use anyhow::{Context, Result, bail};
use clap::Args;

use super::plan::{available_host_memory, gib_bytes};
use crate::backend::datasheet::datasheet;
use crate::backend::select::Device;
use crate::train::console::gib;
use crate::train::plan::{self, Choice, Request};

#[derive(Args, Debug)]
pub struct FitMemoryFlag {
    /// Choose --recompute-*, --offload-*, --lmhead-chunks (and, with --gpus, --zero-level)
    /// as `smelt plan` would: the fastest that fits in GIB per device [default on a GPU:
    /// what GPU 0 has free, less smelt plan's reserve].
    #[arg(long, value_name = "GIB", num_args = 0..=1)]
    fit_memory: Option<Option<f64>>,
}

impl FitMemoryFlag {
    /// What the flag refuses, checked before anything is written: memory flags chosen by
    /// hand beside it, a figure that is no size, and the CPU without a figure.
    pub fn check(&self, device: &Device, chosen_by_hand: bool) -> Result<()> {
        if self.fit_memory.is_none() {
            return Ok(());
        }
        if chosen_by_hand {
            bail!(
                "--fit-memory chooses the --recompute-*, --offload-*, --lmhead-chunks and \
                 --zero-level flags itself; leave them out, or leave out --fit-memory"
            );
        }
        match (self.fit_memory, device) {
            (Some(Some(gib)), _) => gib_bytes(gib, "--fit-memory").map(|_| ()),
            (_, Device::Cpu(_)) => bail!(
                "--fit-memory: on the CPU give the memory the run may take, in GiB (--fit-memory 8)"
            ),
            _ => Ok(()),
        }
    }

    /// `smelt plan`'s pick for the run that `request` describes (printed), or `None` without
    /// the flag. The budget is the figure given, or on a GPU its free memory, less the
    /// reserve for what smelt does not plan; on the CPU, the figure is the host memory the
    /// run's tensors may take.
    pub fn choose(
        &self,
        device: &Device,
        request: impl FnOnce() -> Result<Request>,
    ) -> Result<Option<Choice>> {
        let Some(asked) = self.fit_memory else {
            return Ok(None);
        };
        let (gpu, budget) = match (device, asked) {
            (Device::Cuda(b), asked) => {
                let bytes = match asked {
                    Some(asked) => gib_bytes(asked, "--fit-memory")?,
                    None => b.memory_report()?.free as u64,
                };
                // An estimate with an H100's figures ranks the choices alike on a GPU with
                // no datasheet entry; refusing to run for want of one would be wrong.
                let gpu = datasheet(b.name()).or(datasheet("H100")).expect("listed");
                (gpu, bytes.saturating_sub(plan::DEVICE_RESERVE))
            }
            (Device::Cpu(_), Some(asked)) => (
                datasheet("H100").expect("listed"),
                gib_bytes(asked, "--fit-memory")?,
            ),
            (Device::Cpu(_), None) => unreachable!("refused by check"),
        };
        let host = available_host_memory().context("--fit-memory")?;
        let choice = plan::fit(
            &request()?,
            gpu,
            &plan::Budget {
                device: budget,
                host,
            },
        )?;
        println!(
            "--fit-memory: {} (in {:.2} GiB per device)",
            choice.flags().join(" "),
            gib(budget)
        );
        Ok(Some(choice))
    }
}
