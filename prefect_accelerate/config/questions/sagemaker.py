"""The "AWS (Amazon SageMaker)" branch: Accelerate's `get_sagemaker_input` questions (reference §2.1.2).

Differences on purpose: AWS keys are asked (secret one without echo on a terminal) but never stored,
printed or put in this process's environment; file paths and the image URI keep their case; the
dynamo mode menu has a real default; the "create the IAM role" option is offered only when boto3 is
importable, and the role is created after every question is answered (not half-way through).
"""

from __future__ import annotations

import json
from typing import Any, TextIO

from prefect_accelerate.config.enums import SAGEMAKER_PARALLEL_EC2_INSTANCES, ComputeEnvironment, SageMakerDistributedType
from prefect_accelerate.config.questions.common import DYNAMO_QUESTIONS, PRECISION_OPTIONS, TF32_NOTICE, answered, yes_no
from prefect_accelerate.config.questions.engine import Answers, Question, options
from prefect_accelerate.errors import ConfigError

#: the role Accelerate creates (and reuses when it exists)
SAGEMAKER_ROLE_NAME = "accelerate_sagemaker_execution_role"

SAGEMAKER_TRUST_POLICY: dict[str, Any] = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}],
}

#: what the execution role may do: SageMaker, pulling images, metrics and logs, the job's S3 data
SAGEMAKER_ROLE_ACTIONS: tuple[str, ...] = (
    "sagemaker:*",
    "ecr:GetDownloadUrlForLayer", "ecr:BatchGetImage", "ecr:BatchCheckLayerAvailability", "ecr:GetAuthorizationToken",
    "cloudwatch:PutMetricData", "cloudwatch:GetMetricData", "cloudwatch:GetMetricStatistics", "cloudwatch:ListMetrics",
    "logs:CreateLogGroup", "logs:CreateLogStream", "logs:DescribeLogStreams", "logs:PutLogEvents", "logs:GetLogEvents",
    "s3:CreateBucket", "s3:ListBucket", "s3:GetBucketLocation", "s3:GetObject", "s3:PutObject",
)

PROFILE, CREDENTIALS = "profile", "credentials"
GIVE_NAME, CREATE_ROLE = "name", "create"

_distributed = lambda a: a.get("sagemaker_distributed_type") != SageMakerDistributedType.NO.value  # noqa: E731
_can_create_role = lambda a: a.env.has_module("boto3")  # noqa: E731

SAGEMAKER_QUESTIONS: tuple[Question, ...] = (
    Question(key="aws_auth", prompt="How do you want to authorize?", kind="choice", default=0,
             options=options("AWS Profile", "Credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
                             values=[PROFILE, CREDENTIALS])),
    Question(key="profile", prompt="Enter your AWS Profile name", default="default", when=answered("aws_auth", PROFILE),
             target="profile"),
    Question(key="aws_access_key_id", prompt="AWS Access Key ID", when=answered("aws_auth", CREDENTIALS),
             intro="The keys are used only while these questions run (to create the IAM role if you ask for it); they "
                   "are not saved. When you launch, provide them through AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                   "or an AWS profile."),
    Question(key="aws_secret_access_key", prompt="AWS Secret Access Key", secret=True,
             when=answered("aws_auth", CREDENTIALS)),
    Question(key="region", prompt="Enter your AWS Region", default="us-east-1", target="region"),
    Question(key="iam_role_management", prompt="Do you already have an IAM Role for executing Amazon SageMaker Training "
             "Jobs?", kind="choice", default=0, when=_can_create_role,
             options=options("Provide IAM Role name", "Create new IAM role using credentials",
                             values=[GIVE_NAME, CREATE_ROLE])),
    Question(key="iam_role_name", prompt="Enter your IAM role name",
             when=lambda a: a.get("iam_role_management", GIVE_NAME) == GIVE_NAME, target="iam_role_name"),
    yes_no("use_custom_image", "Do you want to use custom Docker image?"),
    # Accelerate lower-cases these three answers; an image tag and a file path are case-sensitive
    Question(key="image_uri", prompt="Enter your Docker image", when=answered("use_custom_image"), target="image_uri"),
    yes_no("use_sagemaker_inputs", "Do you want to provide SageMaker input channels with data locations?"),
    Question(key="sagemaker_inputs_file", prompt="Enter the path to the SageMaker inputs TSV file with columns "
             "(channel_name, data_location)", when=answered("use_sagemaker_inputs"), target="sagemaker_inputs_file"),
    yes_no("use_sagemaker_metrics", "Do you want to enable SageMaker metrics?"),
    Question(key="sagemaker_metrics_file", prompt="Enter the path to the SageMaker metrics TSV file with columns "
             "(metric_name, metric_regex)", when=answered("use_sagemaker_metrics"), target="sagemaker_metrics_file"),
    # MODEL_PARALLEL exists in the enum but Accelerate does not offer it (nor give it a distribution)
    Question(key="sagemaker_distributed_type", prompt="What is the distributed mode?", kind="choice", default=0,
             options=options("No distributed training", "Data parallelism",
                             values=[SageMakerDistributedType.NO.value, SageMakerDistributedType.DATA_PARALLEL.value]),
             target="distributed_type"),
    *DYNAMO_QUESTIONS,
    Question(key="ec2_instance_type", prompt="Which EC2 instance type you want to use for your training?", kind="choice",
             options=options(*SAGEMAKER_PARALLEL_EC2_INSTANCES), default=0, when=_distributed, target="ec2_instance_type"),
    Question(key="ec2_instance_type_single", prompt="Which EC2 instance type you want to use for your training?",
             default="ml.p3.2xlarge", convert=str.lower, when=lambda a: not _distributed(a), target="ec2_instance_type"),
    yes_no("debug", "Should distributed operations be checked while running for errors? This can avoid timeout issues "
           "but will be slower.", when=_distributed, target="debug"),
    Question(key="num_machines", prompt="How many machines do you want use?", kind="int", default=1, minimum=1,
             when=_distributed, target="num_machines"),
    Question(key="mixed_precision", prompt="Do you wish to use FP16 or BF16 (mixed precision)?", kind="choice",
             options=PRECISION_OPTIONS, default=0, target="mixed_precision"),
)


def build_sagemaker(a: Answers) -> dict[str, Any]:
    """The config dict for the answers of the SageMaker branch (keys and secrets are never in it)."""
    data: dict[str, Any] = {
        "compute_environment": ComputeEnvironment.AMAZON_SAGEMAKER.value,
        "use_cpu": False,
        "debug": False,
        "num_machines": 1,
    }
    if a.get("iam_role_management") == CREATE_ROLE:
        data["iam_role_name"] = SAGEMAKER_ROLE_NAME
    data.update(a.to_config_dict())
    return data


def sagemaker_notices(a: Answers) -> list[str]:
    return [TF32_NOTICE] if a.get("use_dynamo") and a.get("mixed_precision") == "no" else []


def iam_client(a: Answers) -> Any:
    """A boto3 IAM client with the profile or keys just given (not this process's environment)."""
    import boto3

    if a.get("aws_auth") == CREDENTIALS:
        session = boto3.Session(
            aws_access_key_id=a["aws_access_key_id"], aws_secret_access_key=a["aws_secret_access_key"], region_name=a["region"]
        )
    else:
        session = boto3.Session(profile_name=a["profile"], region_name=a["region"])
    return session.client("iam")


def create_sagemaker_role(client: Any, role_name: str = SAGEMAKER_ROLE_NAME, out: TextIO | None = None) -> bool:
    """Create the SageMaker execution role with its inline policy; False when it already exists (reused)."""
    try:
        client.create_role(RoleName=role_name, AssumeRolePolicyDocument=json.dumps(SAGEMAKER_TRUST_POLICY, indent=2))
    except client.exceptions.EntityAlreadyExistsException:
        print(f"The IAM role {role_name} already exists; using it.", file=out)
        return False
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": list(SAGEMAKER_ROLE_ACTIONS), "Resource": "*"}]}
    client.put_role_policy(
        RoleName=role_name, PolicyName=f"{role_name}_policy_permission", PolicyDocument=json.dumps(policy, indent=2)
    )
    print(f"Created the IAM role {role_name} for SageMaker training jobs.", file=out)
    return True


def finish_sagemaker(a: Answers, out: TextIO | None = None) -> None:
    """The one side effect of the branch besides the file: creating the IAM role when asked to."""
    if a.get("iam_role_management") != CREATE_ROLE:
        return
    from botocore.exceptions import BotoCoreError, ClientError

    make_client = a.env.iam_client_factory or iam_client
    try:
        create_sagemaker_role(make_client(a), SAGEMAKER_ROLE_NAME, out)
    except (BotoCoreError, ClientError) as error:
        raise ConfigError(
            f"Could not create the IAM role {SAGEMAKER_ROLE_NAME} for SageMaker: {error}. Check that the AWS profile "
            f"or keys may create IAM roles (iam:CreateRole, iam:PutRolePolicy), or create a role yourself and run "
            f"`prefect-accelerate config` again choosing \"Provide IAM Role name\". Nothing was written."
        ) from None
