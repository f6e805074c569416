//! The console over HTTPS, against real processes: with `https` configured it answers over
//! TLS to a client that trusts the deployment's CA (no client certificate asked), refuses
//! plain HTTP, and every cookie its sign-in sets is `Secure`; without it, the same sign-in
//! sets no `Secure` cookie, so a browser keeps it on a loopback `http://` address.

use anyhow::{Context, Result, ensure};
use z29c_core::Role;
use z29c_scenarios::cluster::Cluster;

/// curl with the cluster's CA and nothing else: the response's headers (lowercase names)
/// and body.
async fn curl(cluster: &Cluster, args: &[&str], url: &str) -> Result<(Vec<String>, String)> {
    let ca = cluster.operator_tls().ca_file.context("ca")?;
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "30", "-D", "-", "--cacert"])
        .arg(ca)
        .args(args)
        .arg(url)
        .output()
        .await
        .context("run curl")?;
    ensure!(
        out.status.success(),
        "curl {url}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let (head, body) = text.split_once("\r\n\r\n").context("a header block")?;
    let headers = head
        .lines()
        .map(|l| match l.split_once(':') {
            Some((k, v)) => format!("{}:{v}", k.to_ascii_lowercase()),
            None => l.to_owned(),
        })
        .collect();
    Ok((headers, body.to_owned()))
}

/// The CSRF token of the sign-in form.
fn form_csrf(page: &str) -> Result<String> {
    Ok(page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .context("the sign-in form carries a CSRF token")?
        .to_owned())
}

/// The `set-cookie` values among curl's `headers`.
fn set_cookies(headers: &[String]) -> Vec<String> {
    headers
        .iter()
        .filter_map(|h| h.strip_prefix("set-cookie:"))
        .map(|v| v.trim().to_owned())
        .collect()
}

fn secure(cookie: &str) -> bool {
    cookie
        .split(';')
        .any(|a| a.trim().eq_ignore_ascii_case("secure"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_serves_https_with_secure_cookies_and_plain_http_only_without_tls() -> Result<()>
{
    let (mut cluster, pool) = Cluster::start_secure("idempotent", &[]).await?;
    let token = cluster.token("olga", &[Role::Operator])?;

    let console = cluster.add_console_with(&[], true).await?;
    ensure!(console.starts_with("https://"), "{console}");
    // no client certificate: browsers are not asked for one
    let (headers, page) = curl(&cluster, &[], &format!("{console}/login")).await?;
    assert!(headers[0].contains(" 200"), "{headers:?}");
    let csrf = form_csrf(&page)?;
    let page_cookies = set_cookies(&headers);
    let (headers, _) = curl(
        &cluster,
        &["--data", &format!("token={token}&csrf={csrf}")],
        &format!("{console}/login"),
    )
    .await?;
    assert!(headers[0].contains(" 303"), "{headers:?}");
    let signed_in = set_cookies(&headers);
    assert!(
        signed_in.iter().any(|c| {
            let c = c.to_ascii_lowercase();
            c.starts_with("z29c_session=")
                && c.contains("httponly")
                && c.contains("samesite=strict")
        }),
        "{signed_in:?}"
    );
    assert!(
        signed_in.len() >= 2,
        "session and CSRF cookies: {signed_in:?}"
    );
    for c in signed_in.iter().chain(&page_cookies) {
        assert!(secure(c), "a cookie without Secure over HTTPS: {c}");
    }
    // signed in over HTTPS, the console reaches the services
    let cookie = signed_in
        .iter()
        .filter_map(|c| c.split(';').next())
        .collect::<Vec<_>>()
        .join("; ");
    let (headers, body) = curl(
        &cluster,
        &["-H", &format!("cookie: {cookie}")],
        &format!("{console}/api/workflows"),
    )
    .await?;
    assert!(headers[0].contains(" 200"), "{headers:?} {body}");
    // plain HTTP to the HTTPS port is no way in
    let plain = reqwest::Client::new()
        .get(console.replace("https://", "http://") + "/login")
        .send()
        .await;
    assert!(
        plain.is_err() || plain.as_ref().is_ok_and(|r| !r.status().is_success()),
        "{plain:?}"
    );

    // without https: plain HTTP, and no Secure cookie a browser would drop on http://
    let console = cluster.add_console(&[]).await?;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let csrf = form_csrf(
        &http
            .get(format!("{console}/login"))
            .send()
            .await?
            .text()
            .await?,
    )?;
    let r = http
        .post(format!("{console}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={token}&csrf={csrf}"))
        .send()
        .await?;
    assert!(r.status().is_redirection(), "{}", r.status());
    let signed_in: Vec<String> = r
        .headers()
        .get_all(reqwest::header::SET_COOKIE)
        .iter()
        .filter_map(|v| Some(v.to_str().ok()?.to_owned()))
        .collect();
    assert!(
        signed_in.iter().any(|c| c.starts_with("z29c_session=")),
        "{signed_in:?}"
    );
    for c in &signed_in {
        assert!(!secure(c), "a Secure cookie over plain HTTP: {c}");
    }

    pool.close().await;
    cluster.stop().await
}
