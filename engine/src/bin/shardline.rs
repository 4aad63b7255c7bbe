//! The `shardline` command line (its subcommands and exit codes:
//! [`shardline::cli::main`]).

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    shardline::cli::main(std::env::args_os())
}
