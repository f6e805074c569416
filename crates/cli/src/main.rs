//! `z29c`: run the whole system on one machine (`z29c dev`), submit, follow, list and cancel
//! workflows, work the review queue, apply migrations, or run one service.

mod client;
mod dev;
mod infra;

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde::Serialize;
use serde::de::DeserializeOwned;

#[derive(Debug, Parser)]
#[command(
    name = "z29c",
    version,
    about = "A durable workflow-step engine that never reads a lease as a receipt",
    after_help = "Exit codes (status, status --watch and submit --wait alike): 0 done, \
                  accepted, or the workflow completed or still runs; 1 the workflow failed or \
                  was cancelled; 2 bad input; 3 the workflow waits for a person (review); \
                  4 a service could not be reached or failed"
)]
struct Cli {
    /// `text` for people, `json` for programs (one document, or a JSON line per change when
    /// following).
    #[arg(long, global = true, value_enum, default_value = "text")]
    output: client::Output,
    #[command(flatten)]
    access: client::Access,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Everything in one process on loopback, with the demo workflow. Without
    /// Z29C_DATABASE_URL / Z29C_NATS_URL it starts a throwaway PostgreSQL and NATS.
    Dev(dev::DevArgs),
    /// Submit a workflow file (YAML).
    Submit {
        file: PathBuf,
        /// Follow the workflow until it ends, printing each change.
        #[arg(long, conflicts_with = "wait")]
        watch: bool,
        /// Wait until the workflow ends (or needs review), then print it; the exit code says
        /// how it ended, as `status` does.
        #[arg(long)]
        wait: bool,
        #[arg(long, env = "Z29C_SERVER", default_value = "http://127.0.0.1:50051")]
        server: String,
    },
    /// Show a workflow: product states, each step's reason, result and receipt, and the
    /// lease history. The exit code says how it ended (0 while it runs).
    Status {
        workflow_id: String,
        /// Follow it live until it ends.
        #[arg(long)]
        watch: bool,
        #[arg(long, env = "Z29C_SERVER", default_value = "http://127.0.0.1:50051")]
        server: String,
    },
    /// List workflows, newest first: id, name, state, created time.
    List {
        #[command(flatten)]
        args: client::ListArgs,
        #[arg(long, env = "Z29C_SERVER", default_value = "http://127.0.0.1:50051")]
        server: String,
    },
    /// Cancel a workflow. Steps not started are stopped; a step whose effect may exist still
    /// ends in a receipt or in review.
    Cancel {
        workflow_id: String,
        /// Why, in words people will read.
        #[arg(long)]
        reason: String,
        #[arg(long, env = "Z29C_SERVER", default_value = "http://127.0.0.1:50051")]
        server: String,
    },
    /// The review queue: steps whose outcome only a person can establish.
    Review {
        #[command(subcommand)]
        command: client::ReviewCommand,
        #[arg(
            long,
            env = "Z29C_REVIEW_SERVER",
            default_value = "http://127.0.0.1:50053"
        )]
        server: String,
        /// The scheduler's WorkflowService, for each item's workflow and evidence.
        #[arg(long, env = "Z29C_SERVER", default_value = "http://127.0.0.1:50051")]
        workflow_server: String,
    },
    /// Exit 0 when a service's gRPC health check answers SERVING (PostgreSQL and NATS
    /// reachable): a container health check for an image without a shell.
    Probe {
        /// The service's gRPC address.
        #[arg(default_value = "http://127.0.0.1:50051")]
        addr: String,
        /// The service name to ask about; empty asks about the whole server.
        #[arg(long, default_value = "")]
        service: String,
    },
    /// Sign an operator token (HS256) with a secret from a file, for deployments verifying
    /// `auth.hs256_secrets` (an identity provider issues tokens otherwise). Prints the token.
    Token {
        /// Who the token names: recorded in the audit log and on resolutions.
        #[arg(long)]
        subject: String,
        /// A role: viewer, operator or resolver (repeat for several).
        #[arg(long = "role", required = true, value_parser = parse_role)]
        roles: Vec<z29c_core::Role>,
        /// How long the token is valid (e.g. 30m, 8h).
        #[arg(long, default_value = "8h", value_parser = humantime::parse_duration)]
        ttl: std::time::Duration,
        /// File holding the secret (one of the services' `auth.hs256_secrets`).
        #[arg(long, env = "Z29C_TOKEN_SECRET_FILE")]
        secret_file: PathBuf,
        /// The audience the services expect (`auth.audience`).
        #[arg(long, default_value = "z29c")]
        audience: String,
    },
    /// Write NATS credentials for a deployment: an NKey seed per service role
    /// (`<role>.nk`, for each service's `nats_auth.nkey_file`), with `--admin` `admin.nk` for
    /// people, and `auth.conf`, the
    /// `authorization` block for the NATS server's configuration (`include auth.conf`), which
    /// lets each role publish and subscribe only its own subjects under the prefix.
    NatsAuth {
        /// Directory to write into (created if missing); existing keys there are replaced.
        #[arg(long)]
        dir: PathBuf,
        /// The deployment's subject and stream prefix (`prefix`).
        #[arg(long, env = "Z29C_PREFIX", default_value = "z29c")]
        prefix: String,
        /// Keep the keys already in the directory (its `auth.conf` exists): write only where
        /// there are none, so a restart does not lock out running services.
        #[arg(long)]
        keep: bool,
        /// Also write `admin.nk`, a key without limits for people (the `nats` CLI); keep it
        /// away from the directory the services read.
        #[arg(long)]
        admin: bool,
    },
    /// Apply the database migrations.
    Migrate {
        #[arg(long, env = "Z29C_DATABASE_URL")]
        database_url: String,
    },
    /// Run the synthetic destination (the demo's and the tests' outside world).
    Destination {
        #[arg(long, env = "Z29C_LISTEN", default_value = "127.0.0.1:8080")]
        listen: std::net::SocketAddr,
        #[arg(long, env = "Z29C_DATABASE_URL")]
        database_url: String,
        /// Connections to its database at most.
        #[arg(long, env = "Z29C_MAX_CONNECTIONS", default_value_t = 10)]
        max_connections: u32,
    },
    /// Run the scheduler.
    Scheduler(ServiceArgs),
    /// Run an executor.
    Executor(ServiceArgs),
    /// Run an adapter gateway.
    Gateway(ServiceArgs),
    /// Run a recovery worker.
    Recovery(ServiceArgs),
    /// Serve the operator console (a web page) for a running deployment.
    Console(ServiceArgs),
}

#[derive(Debug, clap::Args)]
struct ServiceArgs {
    /// TOML configuration file; Z29C_* environment variables override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print the resulting configuration and exit.
    #[arg(long)]
    dump_config: bool,
}

fn parse_role(s: &str) -> Result<z29c_core::Role, String> {
    s.parse()
        .map_err(|_| format!("'{s}' is not a role: use viewer, operator or resolver"))
}

fn config<T: Serialize + DeserializeOwned + Default + z29c_runtime::Validate>(
    args: &ServiceArgs,
) -> anyhow::Result<Option<T>> {
    let c: T = z29c_runtime::load_config(args.config.as_deref())?;
    if args.dump_config {
        client::Stdout::default().line(z29c_runtime::config::dump(&c)?)?;
        return Ok(None);
    }
    Ok(Some(c))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // one service name per process, for its spans (OTEL_EXPORTER_OTLP_ENDPOINT exports them)
    let service = match &cli.command {
        Command::Dev(_) => "z29c-dev",
        Command::Scheduler(_) => "z29c-scheduler",
        Command::Executor(_) => "z29c-executor",
        Command::Recovery(_) => "z29c-recovery",
        Command::Gateway(_) => "z29c-adapter-gateway",
        Command::Destination { .. } => "z29c-destination",
        Command::Console(_) => "z29c-console",
        _ => "z29c-cli",
    };
    let _telemetry = z29c_telemetry::trace::init(service);
    match run(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let code = e.downcast_ref::<client::Exit>().map_or(4, |x| *x as u8);
            // a closed stderr must not turn an answer into a panic
            let _ = writeln!(std::io::stderr(), "z29c: {e:#}");
            std::process::ExitCode::from(code)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let output = cli.output;
    let access = &cli.access;
    match cli.command {
        Command::Dev(args) => dev::run(args).await,
        Command::Submit {
            file,
            watch,
            wait,
            server,
        } => client::submit(&server, &file, watch, wait, output, access).await,
        Command::Status {
            workflow_id,
            watch,
            server,
        } => client::status(&server, &workflow_id, watch, output, access).await,
        Command::List { args, server } => client::list(&server, args, output, access).await,
        Command::Cancel {
            workflow_id,
            reason,
            server,
        } => client::cancel(&server, &workflow_id, &reason, output, access).await,
        Command::Review {
            command,
            server,
            workflow_server,
        } => client::review(&server, &workflow_server, command, output, access).await,
        Command::Probe { addr, service } => {
            let status = z29c_runtime::probe(&addr, &service, &access.tls()).await?;
            if status != "SERVING" {
                anyhow::bail!("{addr}: {status}");
            }
            Ok(())
        }
        Command::Token {
            subject,
            roles,
            ttl,
            secret_file,
            audience,
        } => {
            let secret = std::fs::read_to_string(&secret_file)
                .with_context(|| format!("--secret-file {}", secret_file.display()))
                .map_err(|e| e.context(client::Exit::BadInput))?;
            let token =
                z29c_security::token::mint(secret.trim(), &audience, &subject, &roles, ttl)?;
            client::Stdout::default().line(token)
        }
        Command::NatsAuth {
            dir,
            prefix,
            keep,
            admin,
        } => {
            if keep && dir.join("auth.conf").exists() {
                return client::Stdout::default()
                    .line(format!("kept the NATS keys in {} (--keep)", dir.display()));
            }
            let names = z29c_bus::Names::new(&prefix)
                .map_err(|e| anyhow::anyhow!("--prefix: {e}").context(client::Exit::BadInput))?;
            let conf =
                z29c_bus::auth::write_keys(&dir, &names, &z29c_bus::auth::NATS_ROLES, admin)?;
            let mut out = client::Stdout::default();
            out.line(format!(
                "wrote {} and a seed per role ({}) for prefix {prefix}",
                conf.display(),
                z29c_bus::auth::NATS_ROLES
                    .iter()
                    .map(|r| format!("{r}.nk"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))?;
            out.line("  NATS server: include auth.conf in its configuration")?;
            out.line(
                "  each service: nats_auth.nkey_file (Z29C_NATS_AUTH__NKEY_FILE) = its role's seed",
            )?;
            if admin {
                out.line(format!(
                    "  people: {} may do anything (nats --nkey); keep it off the services' machines",
                    z29c_bus::auth::ADMIN_SEED
                ))?;
            }
            Ok(())
        }
        Command::Migrate { database_url } => {
            z29c_store::Store::connect(&database_url, 2)
                .await?
                .migrate()
                .await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Destination {
            listen,
            database_url,
            max_connections,
        } => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(max_connections)
                .connect(&database_url)
                .await?;
            let destination = z29c_destination::Destination::install(pool).await?;
            let listener = tokio::net::TcpListener::bind(listen).await?;
            tracing::info!(addr = %listener.local_addr()?, "destination listening");
            let token = z29c_runtime::shutdown_token();
            axum::serve(listener, destination.router())
                .with_graceful_shutdown(token.cancelled_owned())
                .await?;
            Ok(())
        }
        Command::Scheduler(args) => match config(&args)? {
            Some(c) => z29c_scheduler::run(c, z29c_runtime::shutdown_token(), None).await,
            None => Ok(()),
        },
        Command::Executor(args) => match config(&args)? {
            Some(c) => z29c_executor::run(c, z29c_runtime::shutdown_token()).await,
            None => Ok(()),
        },
        Command::Recovery(args) => match config(&args)? {
            Some(c) => z29c_recovery::run(c, z29c_runtime::shutdown_token(), None).await,
            None => Ok(()),
        },
        Command::Console(args) => match config(&args)? {
            Some(c) => z29c_console::run(c, z29c_runtime::shutdown_token(), None).await,
            None => Ok(()),
        },
        Command::Gateway(args) => match config(&args)? {
            Some(c) => z29c_adapter_gateway::run(c, z29c_runtime::shutdown_token(), None).await,
            None => Ok(()),
        },
    }
}
