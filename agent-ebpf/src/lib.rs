//! Empty on purpose: the agent lists this crate as a build-dependency so cargo rebuilds it (and
//! re-embeds the object) when the kernel programs or their dependencies change, and a
//! build-dependency needs a library target. The programs are the binary, `src/main.rs`.
#![no_std]
