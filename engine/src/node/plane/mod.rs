//! The node's sans-IO planes: state machines of the node's executors that
//! take inputs (`handle_*(now, …)`) and hand out outputs (`poll_*()`), with
//! no sockets, timers, threads or clocks of their own. The executors in
//! `node/` are their drivers.

pub mod control;
pub mod data;
pub mod host;
