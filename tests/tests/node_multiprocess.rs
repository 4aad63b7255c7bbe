//! Multi-process tests of `shardline node` on loopback (cluster formation and
//! serving, SIGKILL of a member and of the coordinator's member, graceful
//! leave under load, bad input on both ports, two data cores) and the
//! embedding API in one process. The cases live in `node_cases/`.

mod node_cases;
