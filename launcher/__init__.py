"""The launcher: `shuttle` subcommands, start-up checks, process supervision."""
