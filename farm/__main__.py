from farm.cli import app

app(prog_name="farm")
