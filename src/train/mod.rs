//! Training: the loop and everything around it — data loading, the optimizer and its ZeRO
//! sharding, the learning-rate schedule, checkpoints, logs (JSON Lines and TensorBoard), the
//! console — plus the benchmark and the built-in demo. It sees the model only through `Transformer`'s public methods and
//! any `Backend`.

pub mod bench;
pub mod block_updates;
pub mod checkpoint;
pub mod console;
pub mod demo;
pub mod driver;
pub mod guard;
pub mod health;
pub mod inject;
pub mod loader;
pub mod log;
pub mod metrics;
pub mod optimizer;
pub mod options;
pub mod scalars;
pub mod schedule;
pub mod step_losses;
pub mod tensorboard;
pub mod trainer;
pub mod zero;

pub use options::{ModelSource, Options};
pub use trainer::{Summary, train};
