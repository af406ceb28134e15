"""A TCP sink for the harness tests: `python sink.py ADDR PORT` listens on ADDR only, reads each
connection to its end and answers with the byte count it read."""

import socket
import sys

with socket.create_server((sys.argv[1], int(sys.argv[2]))) as server:
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            n = 0
            while chunk := conn.recv(1 << 16):
                n += len(chunk)
            conn.sendall(str(n).encode())
