from llmctl.cli.main import run

run()
