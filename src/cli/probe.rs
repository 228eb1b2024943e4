//! `ratelimitd probe`: a health endpoint of a running service, for container
//! HEALTHCHECKs.

use std::{io::Write as _, process::ExitCode};

/// Runs `ratelimitd probe`: 0 when `path` on `addr` answers 200, 1 otherwise.
pub fn run(addr: &str, path: &str) -> ExitCode {
    use std::io::Read;
    let fetched = (|| -> std::io::Result<String> {
        let addr: std::net::SocketAddr = addr
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
        let mut stream = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2))?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
        write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    })();
    match fetched {
        Ok(response) if response.starts_with("HTTP/1.1 200") => ExitCode::SUCCESS,
        Ok(response) => {
            eprintln!("{}", response.lines().next().unwrap_or("empty response"));
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("probe {addr}{path}: {e}");
            ExitCode::from(1)
        }
    }
}
