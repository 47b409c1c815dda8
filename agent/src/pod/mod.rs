//! The pure decision step: a pod's spec as plain data (`spec`), and what to do given what has
//! been observed of its containers (`decide`). No I/O here.
pub mod decide;
pub mod spec;
pub mod status;

#[cfg(test)]
mod fixtures;
