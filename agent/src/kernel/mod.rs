//! The kernel side seen from user space: layout discovery (BTF), program loading, event stream.
pub mod btf;
pub mod container_main;
pub mod events;
pub mod layout;
pub mod programs;

pub use events::{Event, EventStream, HeldProcess, ProcessEnd, ProcessExit};
pub use programs::{Attach, Programs};
