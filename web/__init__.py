"""pocketdiff.web: a bundle's page in the browser (LiteRT.js on WebGPU), `pocketdiff web` / `serve`.

Stage folder web/ mapped to pocketdiff.web. It reads bundles through export's manifest
checks and its reference runner (run-bundle), as the demo does; nothing imports it but the CLI.
"""
