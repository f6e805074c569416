//! TLS to PostgreSQL is set in the URL, as libpq does (`sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`): the store speaks TLS when asked, refuses a server its CA did not sign, and the
//! server's own view (`pg_stat_ssl`) confirms which it was.

use z29c_store::Store;

fn url(params: &str) -> String {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/postgres".into());
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}{params}")
}

async fn ssl_in_use(store: &Store) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

#[tokio::test]
async fn the_store_speaks_tls_to_postgresql_when_the_url_asks() {
    let tls = Store::connect(&url("sslmode=require"), 1).await.unwrap();
    assert!(ssl_in_use(&tls).await, "sslmode=require is TLS");
    let plain = Store::connect(&url("sslmode=disable"), 1).await.unwrap();
    assert!(!ssl_in_use(&plain).await, "sslmode=disable is plaintext");
}

#[tokio::test]
async fn a_server_certificate_from_another_ca_is_refused_at_once() {
    let dir = std::env::temp_dir().join(format!("z29c-pg-tls-{}", uuid::Uuid::new_v4().simple()));
    let pki = z29c_security::pki::DevPki::generate(&dir, &[]).unwrap();
    let ca = pki.dir.join("ca.pem");
    let started = std::time::Instant::now();
    let e = Store::connect(
        &url(&format!("sslmode=verify-full&sslrootcert={}", ca.display())),
        1,
    )
    .await
    .unwrap_err();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(10),
        "a certificate error is not worth retrying ({e:?})"
    );
    assert!(
        format!("{e:?}").to_lowercase().contains("certificate"),
        "{e:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
