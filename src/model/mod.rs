//! The transformer, written once over any `Backend`: its configuration, parameter layout,
//! activation plan, forward, backward and recompute. It knows nothing of optimizers,
//! schedules or files.

pub mod activations;
mod backward;
pub mod config;
mod decode;
mod forward;
pub mod fp8;
pub mod grads;
mod head;
mod init;
mod linear;
mod mlp;
pub mod params;
pub mod presets;
mod residuals;
mod stash;
mod transformer;

pub use activations::Recompute;
pub use backward::{GradEvent, GradEvents};
pub use config::{Architecture, ModelConfig};
pub use decode::KvCache;
pub use fp8::MatmulPrecision;
pub use head::LossOptions;
pub use params::{ParamKind, Params};
pub use transformer::{Gradients, ModelOptions, ModelPlan, Transformer};
