//! `--fit-memory`, shared by `smelt train` and `smelt bench`: the memory flags that `smelt
//! plan` would pick for the run, within a budget per device.

use anyhow::{Context, Result, bail};
use clap::Args;

use super::gib_bytes;
use crate::backend::datasheet::datasheet;
use crate::backend::select::Device;
use crate::plan::{self, Choice, Fit, Request, available_host_memory};
use crate::train::console::gib;

#[derive(Args, Debug)]
pub struct FitMemoryFlag {
    /// Choose --recompute-*, --offload-*, --lmhead-chunks (and, with --gpus, --zero-level)
    /// as `smelt plan` would: the fastest that fits in GIB per device [default on a GPU:
    /// what GPU 0 has free, less smelt plan's reserve].
    #[arg(long, value_name = "GIB", num_args = 0..=1)]
    fit_memory: Option<Option<f64>>,
}

/// How a command would run its step in smaller micro-batches, which the error names when
/// nothing fits at its own.
#[derive(Clone, Copy, Debug)]
pub enum SmallerBatch {
    /// `smelt train`: the same sequences per step, in more micro-steps.
    WithAccumulation,
    /// `smelt bench`, which has no `--grad-accumulation`: a smaller step.
    Alone,
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
        &self, device: &Device, smaller: SmallerBatch, request: impl FnOnce() -> Result<Request>,
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
        let request = request()?;
        let budget = plan::Budget {
            device: budget,
            host,
        };
        let fit = plan::fit(&request, gpu, &budget)?;
        let choice = chosen(fit, request.batch, gib(budget.device), smaller)?;
        println!(
            "--fit-memory: {} (in {:.2} GiB per device)",
            choice.flags().join(" "),
            gib(budget.device)
        );
        Ok(Some(choice))
    }
}

/// The choice `fit` made, or the error that says what would fit instead, in the flags of
/// the command.
fn chosen(fit: Fit, asked: usize, budget: f64, smaller: SmallerBatch) -> Result<Choice> {
    match (fit, smaller) {
        (Fit::Chosen(choice), _) => Ok(choice),
        (Fit::Smaller { batch, micro_steps }, smaller) => {
            let flags = match smaller {
                SmallerBatch::WithAccumulation => {
                    format!("--batch-size {batch} --grad-accumulation {micro_steps}")
                }
                SmallerBatch::Alone => format!("--batch-size {batch}"),
            };
            bail!(
                "--fit-memory: nothing fits at --batch-size {asked} in {budget:.2} GiB; {flags} \
                 would (smelt plan lists the choices)"
            )
        }
        (Fit::Nothing, _) => bail!(
            "--fit-memory: nothing fits in {budget:.2} GiB, even one sequence per micro-batch \
             with everything recomputed and offloaded (smelt plan lists what each choice needs)"
        ),
    }
}
