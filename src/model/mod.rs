//! The transformer, written once over any `Backend`: its configuration, parameter layout,
//! activation plan, forward, backward and recompute. It knows nothing of optimizers,
//! schedules or files.

mod activations;
mod backward;
mod block;
pub mod config;
mod decode;
pub mod documents;
mod forward;
mod fp8;
mod head;
mod init;
mod int8;
mod layer_major;
mod linear;
mod linear_layers;
mod mlp;
pub mod params;
pub mod presets;
mod recompute;
mod recorded;
mod residuals;
pub mod shared_slots;
mod stash;
pub mod streaming;
mod transformer;

pub use backward::{BlockEvent, BlockEvents};
pub use config::{Architecture, MatmulFlops, ModelConfig};
pub use decode::KvCache;
pub use documents::Documents;
pub use head::LossOptions;
pub use linear::{Int8Options, MatmulPrecision};
pub use params::{ParamKind, Params};
pub use recompute::Recompute;
pub use transformer::{Gradients, ModelOptions, ModelPlan, Transformer, Weights};
